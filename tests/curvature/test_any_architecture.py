"""Every curvature product on every architecture of the zoo equals a slow reference: the dense Jacobian by
ordinary autograd, one sample and one logit at a time (float64, tiny models). Where a fast path and its
fallback both run, they agree."""
from __future__ import annotations

import pytest
import torch

from scrubnet.curvature.fallbacks import force_paths, probe_paths
from scrubnet.curvature.fisher import fisher_diag
from scrubnet.curvature.ggn import ggn_vector_product
from scrubnet.curvature.jacobian_rows import JacobianRows
from scrubnet.curvature.kernels import func_per_sample_grads
from scrubnet.curvature.ntk import iter_jacobian_rows, jacobian_jvp, jacobian_vjp, ntk_diag_blocks, ntk_gram
from scrubnet.curvature.params import flatten, trainable_params
from scrubnet.models.call import call_model
import zoo

TOL = 1e-9


def reference_jacobian(model, x) -> torch.Tensor:
    """J (N·c × p) sample-major, by torch.autograd on a per-sample, per-logit loop."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    with torch.enable_grad():
        for i in range(len(x)):
            f = call_model(model, x[i:i + 1])[0]
            for k in range(f.shape[0]):
                gs = torch.autograd.grad(f[k], params, retain_graph=True, allow_unused=True)
                rows.append(torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if g is None else g.reshape(-1)
                                       for g, p in zip(gs, params)]))
    return torch.stack(rows)


def rel(a, b) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


@pytest.fixture(scope="module", params=zoo.ZOO_NAMES)
def case(request):
    model, x = zoo.build(request.param)
    with torch.no_grad():
        logits = call_model(model, x)
    return request.param, model, x, reference_jacobian(model, x), logits


def test_per_sample_gradients_and_jacobian_rows(case):
    name, model, x, jac, logits = case
    n, c = logits.shape
    params = trainable_params(model)
    buffers = {k: v for k, v in model.named_buffers()}
    cot = torch.eye(c, dtype=torch.float64).expand(n, c, c)
    paths = probe_paths(model, x)
    with paths.context():
        per = func_per_sample_grads(model, params, list(params), buffers, x, cot, per_sample=paths.per_sample)
    got = torch.cat([per[k].reshape(n * c, -1) for k in params], dim=1)
    assert rel(got, jac) < TOL
    rows = torch.zeros_like(jac)
    for sl, (lo, hi), r in iter_jacobian_rows(model, x):
        rows[sl.start * c:sl.stop * c, lo:hi] += r
    assert rel(rows, jac) < TOL


def test_layer_table_covers_every_parameter_once(case):
    name, model, x, jac, logits = case
    eng = JacobianRows(model, x)
    spans = sorted([s for lay in eng.layers for s in (lay.weight, lay.bias) if s is not None]
                   + [eng.offsets[k] for k in eng.generic_names])
    assert spans[0][0] == 0 and spans[-1][1] == eng.p == jac.shape[1]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # every layer in the table has a capture whose rows equal the reference columns
    cap = eng.capture(x)
    c = logits.shape[1]
    for lay in eng.layers:
        for (lo, hi), r in eng.rows(cap, lay):
            # relative to the whole Jacobian: a key bias's rows are zero up to rounding (softmax cancels them)
            assert float((r - jac[:, lo:hi]).norm()) < TOL * float(jac.norm()), lay.name
    assert len(x) * c == jac.shape[0]


def test_fisher_diagonal(case):
    name, model, x, jac, logits = case
    n, c = logits.shape
    p = torch.softmax(logits, -1)
    j3 = jac.reshape(n, c, -1)
    dlogp = j3 - (p.unsqueeze(-1) * j3).sum(1, keepdim=True)          # ∂ log p_k / ∂w
    ref = (p.unsqueeze(-1) * dlogp ** 2).sum(1).mean(0)
    got = flatten(fisher_diag(model, x, kind="true"))
    assert rel(got, ref) < TOL
    y = torch.arange(n) % c
    ref_emp = (dlogp[torch.arange(n), y] ** 2).mean(0)
    assert rel(flatten(fisher_diag(model, x, y, kind="empirical")), ref_emp) < TOL


def test_jvp_vjp_ggn_products(case):
    name, model, x, jac, logits = case
    n, c = logits.shape
    g = torch.Generator().manual_seed(0)
    v = torch.randn(jac.shape[1], generator=g, dtype=torch.float64)
    u = torch.randn(n, c, generator=g, dtype=torch.float64)
    assert rel(jacobian_jvp(model, x, v, batch_size=3), (jac @ v).reshape(n, c)) < TOL
    assert rel(jacobian_vjp(model, x, u, batch_size=3), jac.T @ u.reshape(-1)) < TOL
    p = torch.softmax(logits, -1)
    h = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    jv = (jac @ v).reshape(n, c)
    ref = jac.T @ torch.einsum("nab,nb->na", h, jv).reshape(-1) / n
    assert rel(ggn_vector_product(model, x, v, batch_size=3), ref) < TOL


def test_ntk_gram_and_blocks(case):
    name, model, x, jac, logits = case
    n, c = logits.shape
    theta = jac @ jac.T
    assert rel(ntk_gram(model, x), theta) < TOL
    assert rel(ntk_gram(model, x, memory_budget_bytes=4000), theta) < TOL     # chunked / grouped schedule
    assert rel(ntk_gram(model, x[:2], x[1:]), jac[:2 * c] @ jac[c:].T) < TOL
    blocks = torch.stack([theta[i * c:(i + 1) * c, i * c:(i + 1) * c] for i in range(n)])
    assert rel(ntk_diag_blocks(model, x), blocks) < TOL


def test_fast_paths_and_fallbacks_agree(case):
    """Each fallback forced where the fast path runs too: the same numbers."""
    name, model, x, jac, logits = case
    paths = probe_paths(model, x)
    n, c = logits.shape
    v = torch.randn(jac.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref_jv = (jac @ v).reshape(n, c)
    for forced in ({"jvp": "double-vjp"}, {"per_sample": "loop"}, {"kernels": "non-fused"},
                   {"unhooked": tuple(trainable_params(model))}):
        with force_paths(**forced):
            assert rel(jacobian_jvp(model, x, v), ref_jv) < TOL, forced
            assert rel(ntk_gram(model, x), jac @ jac.T) < TOL, forced
            if "kernels" not in forced or paths.kernels == "default":
                f_forced = flatten(fisher_diag(model, x))
            else:
                f_forced = None
        if f_forced is not None:
            assert rel(f_forced, flatten(fisher_diag(model, x))) < TOL, forced
    report = paths.as_dict()
    assert set(report) == {"kernels", "jvp", "per_sample", "layer_table", "unhooked"}


EXPECTED = {   # what the probe must find (float64 CPU): fused kernels without forward-mode rules, vmap failures,
    # functionally used / tied weights
    "transformer_encoder": {"kernels": "non-fused"},
    "mha": {"kernels": "non-fused", "unhooked": ("attn.out_proj.bias", "attn.out_proj.weight")},
    "sdpa_groupnorm": {"kernels": "non-fused"},
    "lstm": {"per_sample": "loop"},
    "gru": {"per_sample": "loop"},
    "bert": {"kernels": "non-fused", "per_sample": "loop", "unhooked": ()},
    "shared": {"unhooked": ("a.weight",)},
    "nested": {},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe_finds_the_fallbacks(name):
    model, x = zoo.build(name)
    paths = probe_paths(model, x).as_dict()
    for k, v in EXPECTED[name].items():
        assert paths[k] == (list(v) if k == "unhooked" else v), (k, paths)
    if not EXPECTED[name]:
        assert paths == {"kernels": "default", "jvp": "forward", "per_sample": "vmap", "layer_table": "hooks",
                         "unhooked": []}


def test_bert_mask_changes_the_logits():
    model, x = zoo.build("bert")
    from scrubnet.models.call import ModelInputs
    unmasked = ModelInputs(x.main, {"attention_mask": torch.ones_like(x.extras["attention_mask"])})
    assert float((call_model(model, x) - call_model(model, unmasked)).abs().max()) > 1e-2


def test_float32_lstm_uses_non_fused_kernels_and_matches():
    """float32 LSTM on CPU runs oneDNN's fused RNN (no forward-mode rule): the probe switches it off."""
    model, x = zoo.build("lstm")
    model = model.float()
    paths = probe_paths(model, x)
    assert paths.kernels == "non-fused" or paths.jvp == "double-vjp"
    jac = reference_jacobian(model.double(), x)
    model = model.float()
    v = torch.randn(jac.shape[1], generator=torch.Generator().manual_seed(4))
    got = jacobian_jvp(model, x, v)
    assert rel(got.double(), (jac @ v.double()).reshape(got.shape)) < 1e-4


@pytest.mark.parametrize("method", ["fisher", "newton", "ntk"])
def test_methods_report_their_fallbacks(method):
    """The curvature methods run on nn.MultiheadAttention (which crashed inside torch before) and report the
    paths they took."""
    from scrubnet.api import forget
    model, x = zoo.build("mha", n=10)
    with torch.no_grad():
        y = call_model(model, x).argmax(-1)
    _, res = forget(model, (x[:8], y[:8]), (x[8:], y[8:]), method=method, num_classes=zoo.C, force=True,
                    on_failure="return")
    fb = res.report["fallbacks"]
    assert fb["kernels"] == "non-fused" and fb["layer_table"] == "hooks+autograd"
    assert fb["unhooked"] == ["attn.out_proj.bias", "attn.out_proj.weight"]


def test_cost_multipliers_price_the_paths():
    from scrubnet.curvature.fallbacks import AutodiffPaths, cost_multipliers
    assert cost_multipliers(AutodiffPaths()) == {"jvp": 1.0, "per_sample_batch1": 0.0, "unhooked_params": 0.0}
    slow = AutodiffPaths(jvp="double-vjp", per_sample="loop", unhooked=("a", "b"))
    assert cost_multipliers(slow) == {"jvp": 2.0, "per_sample_batch1": 1.0, "unhooked_params": 2.0}


@pytest.mark.parametrize("name", ["lstm", "mha", "transformer_encoder", "bert"])
def test_kfac_input_factor_of_the_head(name):
    """K-FAC runs on integer tokens, ModelInputs and attention (fast path on): the head's input factor is
    the mean of [a, 1][a, 1]ᵀ over its inputs."""
    from scrubnet.curvature.kfac import compute_kfac
    model, x = zoo.build(name)
    head_name = {"bert": "classifier"}.get(name, "head")
    head = dict(model.named_modules())[head_name]
    seen = []
    h = head.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    with torch.no_grad():
        call_model(model, x)
    h.remove()
    a = torch.cat([seen[0], torch.ones(len(x), 1, dtype=torch.float64)], 1)
    factors = compute_kfac(model, x, loss="ce")
    assert rel(factors[head_name].A, a.T @ a / len(x)) < TOL
