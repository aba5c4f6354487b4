"""K-FAC factors against the dense Fisher / GGN on one-layer cases where the factorisation is exact."""
import pytest
import torch
from torch import nn

from scrubnet.curvature.kfac import KFACPreconditioner, compute_kfac
from tests.dense_refs import dense_ggn


def kron_in_param_order(fac, out_dim, in_dim):
    """G ⊗ A is ordered as vec([W | b]); reorder to (vec W, b)."""
    k = fac.dense()
    idx = torch.arange(out_dim * (in_dim + 1)).view(out_dim, in_dim + 1)
    order = torch.cat([idx[:, :in_dim].reshape(-1), idx[:, in_dim]])
    return k[order][:, order]


def test_linear_mse_factors_equal_dense_fisher():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(10, 4, dtype=torch.float64)
    facs = compute_kfac(lin, x, loss="mse", batch_size=4)  # several batches
    fac = facs[""]
    torch.testing.assert_close(fac.G, torch.eye(3, dtype=torch.float64))
    torch.testing.assert_close(kron_in_param_order(fac, 3, 4), dense_ggn(lin, x, "mse"), rtol=1e-10, atol=1e-12)


def test_linear_ce_single_sample_equals_dense_fisher():
    torch.manual_seed(1)
    lin = nn.Linear(5, 4).double()
    x = torch.randn(1, 5, dtype=torch.float64)
    fac = compute_kfac(lin, x, loss="ce")[""]
    torch.testing.assert_close(kron_in_param_order(fac, 4, 5), dense_ggn(lin, x, "ce"), rtol=1e-10, atol=1e-12)


def test_conv_covering_the_input_equals_linear():
    torch.manual_seed(2)
    conv = nn.Conv1d(2, 3, kernel_size=5).double()  # input length 5 → one position
    x = torch.randn(8, 2, 5, dtype=torch.float64)
    model = nn.Sequential(conv, nn.Flatten())
    fac = compute_kfac(model, x, loss="mse")["0"]
    torch.testing.assert_close(kron_in_param_order(fac, 3, 10), dense_ggn(model, x, "mse"), rtol=1e-10, atol=1e-12)


def test_preconditioner_is_the_damped_inverse():
    torch.manual_seed(3)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(20, 4, dtype=torch.float64)
    facs = compute_kfac(lin, x, loss="mse")
    names = ["weight", "bias"]
    pre = KFACPreconditioner({"": facs[""]}, ["weight", "bias"], [lin.weight.shape, lin.bias.shape], damping=0.3)
    g = torch.randn(15, dtype=torch.float64)
    dense = kron_in_param_order(facs[""], 3, 4) + 0.3 * torch.eye(15, dtype=torch.float64)
    torch.testing.assert_close(pre(g), torch.linalg.solve(dense, g), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError):
        KFACPreconditioner(facs, names, [lin.weight.shape, lin.bias.shape], damping=0.0)
