"""ML-Forgetting from the user's own network, the frozen-prefix cache, the primal path and certified requests.

Every fast path is checked against a slow, obviously-correct twin: the dense normal equations of the
linearised part built from per-sample Jacobians of the *whole* network (torch.func.jacrev), solved with
torch.linalg.solve on the retained samples only.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap

from scrubnet.curvature.solvers import conjugate_gradient
from scrubnet.mlforget.model import MLConfig, forget_request, retrain_user_weights
from scrubnet.mlforget.prefix import PrefixSplit
from scrubnet.mlforget.solve import SolverConfig, certified_cg
from scrubnet.mlforget.user import find_head, ml_from_network
from scrubnet.models.linearized import LinearizedModel


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn(self.conv(x)))


class TinyResCNN(nn.Module):
    """A hand-written CNN with BatchNorm and a residual block; head ``fc``."""

    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.block = Block(6)
        self.fc = nn.Linear(6, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def trained_net(n=48, seed=0):
    """Trained with plain SGD + ordinary weight decay (no pull), BatchNorm statistics learnt; float64."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 3, 6, 6, generator=g) + 0.8 * y.view(-1, 1, 1, 1).double().float()
    torch.manual_seed(seed)
    net = TinyResCNN()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(15):
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval().double(), x.double(), y


def dense_retrain(state, x, y, keep):
    """The slow twin: w* of the mean-MSE ridge problem on the kept samples, from per-sample Jacobians of the
    whole ML network (no prefix, no factor, no Woodbury)."""
    model = state.model
    net = model.base
    names = model.linearized_names
    params = {n: p.detach().double() for n, p in net.named_parameters()}
    buffers = dict(net.named_buffers())

    def f(w, xi):
        return functional_call(net, ({**params, **w}, buffers), (xi.unsqueeze(0),)).squeeze(0)

    xs, ys = x[keep], y[keep]
    jac = vmap(jacrev(f), in_dims=(None, 0))({n: params[n] for n in names}, xs)
    c = state.num_classes
    j = torch.cat([jac[n].reshape(len(xs), c, -1) for n in names], 2).reshape(len(xs) * c, -1)
    with torch.no_grad():
        f0 = functional_call(net, (params, buffers), (xs,))
    r = (f0 - state.config.target_scale * F.one_hot(ys, c).double()).reshape(-1)
    n_r = len(ys)
    h = j.T @ j / n_r + state.config.mu * torch.eye(j.shape[1], dtype=j.dtype)
    return torch.linalg.solve(h, -(j.T @ r) / n_r)


def test_head_is_found_by_name():
    net, _, _ = trained_net(12)
    assert find_head(net) == "fc"
    seq = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_head(seq) == "3"


def test_prefix_split_reproduces_the_network_and_refuses_skips_into_the_linear_part():
    net, x, _ = trained_net(12)
    head = PrefixSplit.of(LinearizedModel(net, prefixes=["fc"]), check=x[:4])
    assert head is not None and head.head_linear
    assert torch.allclose(head.suffix_model.base(head.features(x)), net(x), atol=1e-12, rtol=0)
    assert head.features(x) is head.features(x)  # computed once per input tensor
    deep = PrefixSplit.of(LinearizedModel(net, prefixes=["block", "fc"]), check=x[:4])
    assert deep is not None and not deep.head_linear
    # the block's own conv is linearised: the residual reads the block input = the cut, still valid;
    # linearising the stem's BN makes the prefix weightless (only the stem conv) -> still a split
    assert PrefixSplit.of(LinearizedModel(net, prefixes=None), check=x[:4]) is None  # nothing frozen before


@pytest.mark.parametrize("linearize,solver,expect", [(None, "auto", "primal"), (["block", "fc"], "auto", "dual"),
                                                     (["block", "fc"], "primal", "primal")])
def test_request_from_the_users_network_equals_retraining_the_linearised_part(linearize, solver, expect):
    """p = 21 (head block q = 7) vs N·c = 144: the primal; block + head p = 357 > N·c: the dual, or the
    generic (non-block) primal when forced."""
    net, x, y = trained_net(48)
    state = ml_from_network(net, x, y, 3, linearize=linearize,
                            config=MLConfig(leaky_slope=None, sigma=0.0, solver=SolverConfig(solver=solver)))
    assert state.prefix is not None and state.core_ids.numel() == 0
    assert state.train_info["train_solver"] == expect
    # training = the dense minimiser on all samples
    w_all = dense_retrain(state, x, y, torch.ones(48, dtype=torch.bool))
    assert torch.allclose(state.model.delta_flat(), w_all, rtol=0, atol=1e-10 * float(w_all.abs().max()))
    forgotten = torch.zeros(48, dtype=torch.bool)
    downdates = []
    for req in ([3, 17, 30], [5, 40], [1, 2, 8, 9], [20, 21]):
        out = forget_request(state, x, y, req, sigma=0.0)
        assert out.info.solver == expect
        downdates.append(out.info.extra.get("primal_downdate"))
        forgotten[req] = True
        w_star = dense_retrain(state, x, y, ~forgotten)
        err = float((out.w_before_noise - w_star).abs().max())
        assert err <= 1e-10 * float(w_star.abs().max()), err
        cert = out.info.extra["certificate"]
        assert cert["weight_error_bound"] >= float(torch.linalg.vector_norm(out.w_before_noise - w_star)) - 1e-12
    # the retraining yardstick agrees too
    assert torch.allclose(retrain_user_weights(state, x, y), w_star, rtol=0, atol=1e-10 * float(w_star.abs().max()))
    if linearize is None:   # head block q = 7: the removed rows (3, 5, 9, 11) pass q at the third request; the
        assert downdates == ["woodbury", "woodbury", "direct", "direct"]   # fourth adds 2 rows to the third's Gram


@pytest.mark.parametrize("solver", ["dual", "cg"])
def test_dual_and_cg_on_cached_features_equal_the_primal(solver):
    net, x, y = trained_net(40)
    cfg = MLConfig(leaky_slope=None, sigma=0.0, solver=SolverConfig(solver=solver, weight_tol=1e-11))
    state = ml_from_network(net, x, y, 3, config=cfg)
    out = forget_request(state, x, y, [1, 2, 33], sigma=0.0)
    keep = torch.ones(40, dtype=torch.bool)
    keep[[1, 2, 33]] = False
    w_star = dense_retrain(state, x, y, keep)
    assert float((out.w_before_noise - w_star).abs().max()) <= 1e-9 * float(w_star.abs().max())


def test_certified_cg_bound_holds_and_beats_the_residual_bound():
    g = torch.Generator().manual_seed(3)
    q = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=torch.float64))[0]
    ev = torch.logspace(-2, 2, 60, dtype=torch.float64)
    a = (q * ev) @ q.T
    b = torch.randn(60, generator=g, dtype=torch.float64)
    x_star = torch.linalg.solve(a, b)
    for target in (1e-1, 1e-3, 1e-6):
        x, info = certified_cg(lambda v: a @ v, b, lam_min=1e-2, target=target, max_iter=500)
        err = float(torch.linalg.vector_norm(x - x_star))
        assert info["converged"] and err <= info["weight_error_bound"] <= target
        assert info["weight_error_bound"] <= info["residual_bound"]
        # the plain rule ‖r‖/λ_min ≤ target needs more iterations than the certified one
        plain = conjugate_gradient(lambda v: a @ v, b, tol=target * 1e-2 / float(torch.linalg.vector_norm(b)),
                                   max_iter=500)[1].iterations
        assert info["iterations"] < plain


def test_certified_request_meets_its_budget_and_records_the_certificate():
    net, x, y = trained_net(40)
    cfg = MLConfig(leaky_slope=None, sigma=1e-2, solver=SolverConfig(solver="cg", precond="none"))
    state = ml_from_network(net, x, y, 3, linearize=["block", "fc"], config=cfg)
    out = forget_request(state, x, y, [4, 9], budget_nats=0.1)
    cert = out.info.extra["certificate"]
    assert out.info.solver == "cg-certified" and cert["within_budget"] and cert["kl_bound_nats"] <= 0.1
    assert cert["sigma"] == 1e-2 and cert["budget_nats"] == 0.1
    keep = torch.ones(40, dtype=torch.bool)
    keep[[4, 9]] = False
    w_star = dense_retrain(state, x, y, keep)
    true_kl = float(torch.sum((out.w_before_noise - w_star) ** 2)) / (2 * 1e-4)
    assert true_kl <= cert["kl_bound_nats"] + 1e-12
    with pytest.raises(ValueError, match="budget_nats"):
        forget_request(state, x, y, [5], budget_nats=-1.0)
    assert not math.isnan(cert["weight_error_bound"])


def test_a_copied_state_shares_the_features_and_gives_the_same_request():
    net, x, y = trained_net(40)
    state = ml_from_network(net, x, y, 3, config=MLConfig(leaky_slope=None, sigma=0.0))
    h = state.prefix.features(x)
    twin = state.copy()
    assert twin.prefix.features(x) is h  # no second prefix pass
    a = forget_request(state, x, y, [2, 7], sigma=0.0).w_before_noise
    b = forget_request(twin, x, y, [2, 7], sigma=0.0).w_before_noise
    assert torch.equal(a, b)
