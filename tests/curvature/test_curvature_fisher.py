"""Fisher diagonal (vectorised vs the batch-size-1 loop vs a dense GGN) and matrix-free GGN products."""
import pytest
import torch
from torch import nn

from scrubnet.curvature.fisher import fisher_diag, fisher_diag_loop
from scrubnet.curvature.ggn import GGNOperator, ggn_vector_product, mean_loss_and_grad
from scrubnet.curvature.params import flatten, trainable_params
from scrubnet.models import build_model
from tests import dense_refs


def _bn_cnn(seed=0):
    torch.manual_seed(seed)
    m = build_model("cnn2d", (1, 6, 6), 3, seed=seed, channels=3).double()
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.normal_()
                mod.bias.normal_()
    m.train()  # the Fisher must switch to eval mode itself and restore this
    return m


def _max_rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-300)) for k in b)


@pytest.mark.parametrize("method", ["vmap", "layerwise"])
@pytest.mark.parametrize("kind", ["true", "empirical"])
def test_vectorised_fisher_equals_batch_size_one_loop_on_bn_cnn(kind, method):
    m = _bn_cnn()
    x = torch.randn(11, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (11,))
    fast = fisher_diag(m, x, y, kind=kind, batch_size=4, method=method)  # 4 ∤ 11: ragged last batch
    slow = fisher_diag_loop(m, x, y, kind=kind)
    assert set(fast) == set(slow) == {k for k, p in m.named_parameters()}
    # elementwise relative error on every entry that is not structurally tiny
    for k in slow:
        big = slow[k].abs() > 1e-12 * slow[k].abs().max()
        rel = ((fast[k] - slow[k]).abs() / slow[k].abs())[big]
        assert float(rel.max()) < 1e-5, k
    assert m.training and all(mod.training for mod in m.modules())  # modes restored


class _Mixed(nn.Module):
    """Layers the layerwise kernels cover (Linear, strided Conv1d, BatchNorm1d, a 3-D-input Linear) next to a
    bare parameter and a Linear called twice, which must go through the vmap path."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.conv = nn.Conv1d(1, 2, 3, padding=1, stride=2, dilation=1)
        self.bn = nn.BatchNorm1d(2)
        self.tok = nn.Linear(2, 2)        # applied to (B, 3, 2): per-sample sum over tokens
        self.shared = nn.Linear(5, 5)     # called twice
        self.head = nn.Linear(5 + 6, 3)

    def forward(self, x):
        h = self.shared(self.shared(torch.tanh(self.lin(x) * self.scale)))
        c = self.bn(self.conv(x.unsqueeze(1)))                       # (B, 2, 3)
        c = self.tok(c.transpose(1, 2)).flatten(1)                    # (B, 6)
        return self.head(torch.cat([torch.tanh(h), c], 1))


@pytest.mark.parametrize("kind", ["true", "empirical"])
def test_layerwise_with_vmap_fallback_equals_loop(kind):
    torch.manual_seed(4)
    m = _Mixed().double()
    with torch.no_grad():
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(9, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (9,))
    fast = fisher_diag(m, x, y, kind=kind, batch_size=4)
    slow = fisher_diag_loop(m, x, y, kind=kind)
    assert _max_rel(fast, slow) < 1e-10
    assert float(slow["scale"].abs().max()) > 0 and float(slow["shared.weight"].abs().max()) > 0


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight      # tied: one parameter, two modules
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_tied_weights_and_no_grad_context():
    torch.manual_seed(5)
    m = _Tied().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    with torch.no_grad():  # the caller's no_grad must not break the computation
        fast = fisher_diag(m, x, batch_size=4)
    assert _max_rel(fast, fisher_diag_loop(m, x)) < 1e-10


def test_layerwise_conv1d_model_equals_loop():
    m = build_model("cnn1d", (12,), 4, seed=0, channels=3).double()
    x = torch.randn(7, 12, dtype=torch.float64)
    assert _max_rel(fisher_diag(m, x, batch_size=3), fisher_diag_loop(m, x)) < 1e-10


def test_true_fisher_diag_equals_diagonal_of_dense_ggn():
    m = _bn_cnn(1)
    x = torch.randn(7, 1, 6, 6, dtype=torch.float64)
    fd = flatten(fisher_diag(m, x))
    dense = torch.diagonal(dense_refs.dense_ggn(m, x))
    assert torch.allclose(fd, dense, rtol=1e-9, atol=1e-14)


def test_empirical_fisher_closed_form_on_softmax_regression():
    torch.manual_seed(3)
    m = nn.Linear(4, 3).double()
    x = torch.randn(9, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (9,))
    with torch.no_grad():
        p = torch.softmax(m(x), -1)
    r = torch.nn.functional.one_hot(y, 3).double() - p  # ∂ log p_y / ∂ logits
    want_w = torch.einsum("nk,nj->kj", r ** 2, x ** 2) / 9
    want_b = (r ** 2).mean(0)
    got = fisher_diag(m, x, y, kind="empirical", batch_size=2)
    assert torch.allclose(got["weight"], want_w, rtol=1e-10)
    assert torch.allclose(got["bias"], want_b, rtol=1e-10)
    # true Fisher closed form: Σ_k p_k (e_k − p)_j² x² = (p − p²)_j x² ... summed per row j
    var = p - p ** 2  # diag of (diag p − p pᵀ)
    got_true = fisher_diag(m, x)
    assert torch.allclose(got_true["weight"], torch.einsum("nk,nj->kj", var, x ** 2) / 9, rtol=1e-10)


def test_float32_fisher_streams_and_matches_loop():
    m = build_model("mlp", (10,), 4, seed=0, hidden=16)
    x = torch.randn(30, 10)
    a = fisher_diag(m, x, batch_size=7)
    b = fisher_diag_loop(m, x)
    assert _max_rel(a, b) < 1e-5
    assert all(a[k].dtype == torch.float32 for k in a)


def test_fisher_bad_input():
    m = build_model("mlp", (10,), 4, seed=0, hidden=8)
    x = torch.randn(5, 10)
    with pytest.raises(ValueError, match="kind"):
        fisher_diag(m, x, kind="bogus")
    with pytest.raises(ValueError, match="method"):
        fisher_diag(m, x, method="hooks")
    with pytest.raises(ValueError, match="labels"):
        fisher_diag(m, x, kind="empirical")
    with pytest.raises(ValueError, match="empty"):
        fisher_diag(m, x[:0])
    with pytest.raises(ValueError, match="samples"):
        fisher_diag(m, x, torch.zeros(3, dtype=torch.long), kind="empirical")


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_ggn_vector_product_equals_dense_ggn(loss):
    m = _bn_cnn(2)
    x = torch.randn(6, 1, 6, 6, dtype=torch.float64)
    dense = dense_refs.dense_ggn(m, x, loss)
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(dense.shape[0], generator=gen, dtype=torch.float64)
    got = ggn_vector_product(m, x, v, loss=loss, batch_size=4)
    assert torch.allclose(got, dense @ v, rtol=1e-9, atol=1e-12)
    # dict form and damping
    params = trainable_params(m)
    vd = {}
    i = 0
    for k, t in params.items():
        vd[k] = v[i:i + t.numel()].view_as(t)
        i += t.numel()
    gd = ggn_vector_product(m, x, vd, loss=loss)
    assert torch.allclose(flatten(gd), dense @ v, rtol=1e-9, atol=1e-12)
    op = GGNOperator(m, x, loss=loss, batch_size=5, damping=0.3)
    assert torch.allclose(op(v), dense @ v + 0.3 * v, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="flat vector"):
        op(v[:-1])


def test_mean_loss_and_grad_matches_autograd():
    m = _bn_cnn(3)
    x = torch.randn(9, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (9,))
    loss, g = mean_loss_and_grad(m, x, y, batch_size=4)
    m.eval()
    ref = torch.nn.functional.cross_entropy(m(x), y)
    ref_g = torch.autograd.grad(ref, list(m.parameters()))
    assert abs(loss - float(ref.detach())) < 1e-12
    assert torch.allclose(g, torch.cat([t.reshape(-1) for t in ref_g]), rtol=1e-10, atol=1e-14)


def test_monte_carlo_fisher_is_seeded_and_unbiased():
    m = _bn_cnn(2)
    x = torch.randn(12, 1, 6, 6, dtype=torch.float64)
    true = flatten(fisher_diag(m, x))
    a, b = fisher_diag(m, x, kind="mc", seed=3), fisher_diag(m, x, kind="mc", seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)                        # same seed, same numbers
    draws = torch.stack([flatten(fisher_diag(m, x, kind="mc", seed=s)) for s in range(100)])
    assert not torch.equal(draws[0], draws[1])
    # E[mc] = true Fisher: the mean of 100 draws is within a few standard errors of it, entry by entry
    se = draws.std(0) / 100 ** 0.5
    z = ((draws.mean(0) - true).abs() / se.clamp_min(1e-12))[true > 1e-8 * true.max()]
    assert float(z.median()) < 1.5 and float((z < 5).double().mean()) > 0.99


def test_budget_sets_the_batch_and_keeps_the_values():
    from scrubnet.curvature.fisher import plan_fisher
    m = build_model("cnn2d", (1, 8, 8), 4, seed=0, channels=8).double()
    x = torch.randn(20, 1, 8, 8, dtype=torch.float64)
    ref = fisher_diag_loop(m, x)
    small = plan_fisher(m, x[:1], 20, budget_bytes=2 * 2**20)
    big = plan_fisher(m, x[:1], 20, budget_bytes=2**30)
    assert small.batch < big.batch and small.peak_bytes <= 2 * 2**20
    assert _max_rel(fisher_diag(m, x, budget_bytes=2 * 2**20), ref) < 1e-10
    assert _max_rel(fisher_diag(m, x), ref) < 1e-10


def test_position_gram_squared_sums_equal_per_sample_gradients():
    from scrubnet.curvature.kernels import ConvKernel
    torch.manual_seed(6)
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1).double()
    a = torch.randn(5, 3, 7, 7, dtype=torch.float64)
    g = torch.randn(6, 5, 4, 4, 4, dtype=torch.float64)                   # (K, B, C_out, H, W)
    k = ConvKernel()
    want = k.squared_sums(conv, a, g)
    got = k.squared_sums_from_position_gram(conv, a, k.position_gram(conv, g), max_bytes=1)  # 1 sample/chunk
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-10, atol=1e-12), name


def test_batched_columns_rule():
    from scrubnet.curvature.fisher import BATCHED_MIN_BATCH, batched_columns
    assert batched_columns(BATCHED_MIN_BATCH, 10_000) and not batched_columns(BATCHED_MIN_BATCH - 1, 10_000)
    assert batched_columns(11, 11) and not batched_columns(10, 11)        # fewer samples than the minimum: all
    assert not batched_columns(100, 1000, batch_size=101)                 # a given batch must fit too
    assert batched_columns(100, 1000, batch_size=100)


def test_plan_picks_batched_columns_for_small_nets_and_one_column_per_backward_for_a_resnet():
    from scrubnet.curvature.fisher import plan_fisher
    small = build_model("cnn2d", (1, 8, 8), 10, seed=0)
    assert plan_fisher(small, torch.zeros(1, 1, 8, 8), 300).class_chunk == 10
    assert plan_fisher(small, torch.zeros(1, 1, 8, 8), 300, kind="mc").class_chunk == 1   # one column anyway
    big = build_model("resnet18", (3, 32, 32), 10, seed=0, width=1.0).eval()
    p = plan_fisher(big, torch.zeros(1, 3, 32, 32), 256)
    assert p.class_chunk == 1 and p.batch < 64                             # K·B output gradients do not fit


def test_batched_columns_equal_one_column_per_backward_and_the_loop():
    from scrubnet.curvature.fisher import plan_fisher
    m = _bn_cnn()
    x = torch.randn(11, 1, 6, 6, dtype=torch.float64)
    plans = {b: plan_fisher(m, x[:1], len(x), budget_bytes=b) for b in (2**k for k in range(14, 31))}
    per_column = next(b for b, p in plans.items() if p.class_chunk == 1)   # tight budget: one column per backward
    batched = next(b for b, p in plans.items() if p.class_chunk == 3)      # roomy budget: all 3 columns at once
    assert plans[per_column].batch < 11 and plans[batched].batch == 11
    ref = fisher_diag_loop(m, x)
    a = fisher_diag(m, x, budget_bytes=per_column)
    b = fisher_diag(m, x, budget_bytes=batched)
    assert _max_rel(a, ref) < 1e-10 and _max_rel(b, ref) < 1e-10 and _max_rel(a, b) < 1e-10
