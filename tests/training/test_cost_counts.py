"""The cost model's transformer work, Newton's typical estimate and ML-Forgetting's estimate."""
import pytest
import torch
from torch import nn

from scrubnet.cost_guard import estimate
from scrubnet.methods.base import costed_methods
from scrubnet.models.flops import NONGEMM_FLOP_EQUIV, count_work
from scrubnet.training import TrainConfig
from scrubnet.training.cost import BudgetExceeded, check_budget, forward_flops, train_step_flops

L, D, H, F, C = 4, 8, 2, 16, 3


class TinyTransformer(nn.Module):
    def __init__(self, activation="gelu"):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, H, F, dropout=0.0, batch_first=True, activation=activation)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.fc = nn.Linear(D, C)

    def forward(self, x):                       # x: (n, L, D)
        return self.fc(self.enc(x).mean(1))


def test_transformer_work_counts_attention_and_the_non_gemm_elements():
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    x1 = torch.randn(1, L, D)
    gemm, elements = count_work(model, x1)
    # in-projection (3 d×d), out-projection, the two FFN layers, QKᵀ and PV, the head; bias adds are not FLOPs
    assert gemm == L * (2 * D * 3 * D + 2 * D * D + 2 * D * F * 2) + 2 * (2 * H * L * L * (D // H)) + 2 * D * C
    # two LayerNorms (L·D each), the attention scores' softmax (H·L·L), the GELU of the FFN (L·F)
    assert elements == 2 * L * D + H * L * L + L * F
    assert forward_flops(model, x1) == gemm + NONGEMM_FLOP_EQUIV * elements
    # the fast path (a fused op no counter sees) must not hide the layer in a no-grad eval forward
    assert torch.backends.mha.get_fastpath_enabled()
    _, el_train = count_work(model, x1, backward=True)
    # backward: LayerNorm and GELU gradients once more, the scores' P and dS
    assert el_train == elements + 2 * L * D + 2 * H * L * L + L * F
    assert train_step_flops(model, x1) > 2 * forward_flops(model, x1)


def test_nets_without_transformer_ops_have_no_non_gemm_term():
    from scrubnet.models import build_model
    mlp = build_model("mlp", (40,), 5, seed=0)
    gemm, elements = count_work(mlp, torch.randn(1, 40), backward=True)
    assert elements == 0.0 and train_step_flops(mlp, torch.randn(1, 40)) == gemm


def _newton(model, n_r, **kw):
    return estimate(model, n_r, 10, method="newton", num_classes=5, in_shape=(40,), config=TrainConfig(), **kw)


def test_newton_typical_estimate_is_below_its_bound_and_ceilings_use_the_bound():
    from scrubnet.models import build_model
    from scrubnet.methods.newton import NEWTON_TYPICAL_CG_ITERATIONS
    model = build_model("mlp", (40,), 5, seed=0)
    est = _newton(model, 1000)
    assert est.seconds_upper is not None and 0 < est.seconds < est.seconds_upper
    assert est.details["typical_cg_iterations"] == NEWTON_TYPICAL_CG_ITERATIONS
    # the bound: 7 solves of 300 iterations, the typical case one solve of 30: well over 7·300/30 apart
    assert est.seconds_upper / est.seconds > 30
    assert est.ceiling == est.seconds_upper and est.ceiling_vs_retrain == pytest.approx(est.cost_vs_retrain_upper)
    with pytest.raises(BudgetExceeded):
        check_budget(est, max_seconds=0.5 * (est.seconds + est.seconds_upper))
    check_budget(est, max_seconds=1.01 * est.seconds_upper)
    # a cap below the typical count: typical and bound are the same single solve when no safeguard runs
    one = _newton(model, 1000, max_iter=10, safeguard="none", retain_loss_tolerance=None)
    assert one.seconds == pytest.approx(one.seconds_upper)


def _ml(model, n_r, n_f, **kw):
    return estimate(model, n_r, n_f, method="mlforget", num_classes=5, in_shape=(40,),
                    config=TrainConfig(max_epochs=3), **kw)


def test_mlforget_estimate_exists_and_scales():
    from scrubnet.models import build_model
    assert "mlforget" in costed_methods()
    model = build_model("mlp", (40,), 5, seed=0)
    small, big = _ml(model, 190, 10), _ml(model, 380, 20)
    for est in (small, big):
        d = est.details
        assert est.seconds == pytest.approx(d["build_seconds"] + d["request_seconds"])
        assert d["request_vs_retrain"] == pytest.approx(d["request_seconds"] / est.retrain_seconds)
        assert d["gram_rows"] == (est is small and 200 * 5 or 400 * 5)
    # the build's eigendecomposition is cubic in the rows: doubling N more than quadruples it
    assert big.details["build_seconds"] > 4 * small.details["build_seconds"]
    assert big.details["request_seconds"] > small.details["request_seconds"]
    more_forget = _ml(model, 180, 20)
    assert more_forget.details["request_seconds"] > small.details["request_seconds"]
    with pytest.raises(ValueError, match="cg"):
        _ml(model, 1990, 10)                    # 10,000 rows: CG, not priced
