"""Every per-layer curvature kernel against the dense Jacobian, through one shared set of cases
(tiny models × layer types × devices): per-sample gradients (NTK rows), squared sums (Fisher diagonal),
the factored form (ghost NTK contraction, K-FAC's patches) and the generic torch.func fallback."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scrubnet.curvature.fisher import fisher_diag
from scrubnet.curvature.kernels import (BatchNormKernel, ConvKernel, LinearKernel, kernel_for,
                                        registered_kernels)
from scrubnet.curvature.kfac import compute_kfac, kfac_layers
from scrubnet.curvature.ntk import JacobianRows, ntk_gram
from tests import dense_refs

C = 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device"))]


class Scale(nn.Module):
    """A module no kernel covers: its parameter goes through the generic fallback."""

    def __init__(self, n):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.s.view(1, -1, 1, 1)


def _bn(m: nn.Module, seed: int = 3) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g))
            mod.running_var.copy_(0.5 + torch.rand(mod.running_var.shape, generator=g))
            with torch.no_grad():
                mod.weight.copy_(1 + 0.3 * torch.randn(mod.weight.shape, generator=g))
    return m


# name -> (builder, input shape, kernel the case exercises)
CASES = {
    "linear": (lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, C)), (5,), LinearKernel),
    "linear_positions": (lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Flatten(), nn.Linear(8, C)),
                         (2, 5), LinearKernel),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(),
                                     nn.Linear(12, C)), (2, 7), ConvKernel),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(),
                                     nn.Linear(27, C)), (2, 5, 5), ConvKernel),
    "conv2d_dilated_no_bias": (lambda: nn.Sequential(nn.Conv2d(2, 3, (2, 3), dilation=2, bias=False),
                                                     nn.Tanh(), nn.Flatten(), nn.Linear(27, C)),
                               (2, 5, 7), ConvKernel),
    "batchnorm1d": (lambda: _bn(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, C))),
                    (5,), BatchNormKernel),
    "batchnorm2d": (lambda: _bn(nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(),
                                              nn.Flatten(), nn.Linear(48, C))), (2, 4, 4), BatchNormKernel),
    "generic_fallback": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), Scale(4), nn.Tanh(), nn.Flatten(),
                                               nn.Linear(16, C)), (2, 4, 4), None),
}


def _case(name: str, device: str, n: int = 5):
    build, shape, kernel_type = CASES[name]
    torch.manual_seed(0)
    model = build().double().to(device).train()  # consumers must evaluate in eval mode themselves
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    return model, x, kernel_type


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_against_dense_reference(name, device):
    model, x, kernel_type = _case(name, device)
    covered = [m for m in model.modules() if kernel_for(m) is not None]
    if kernel_type is not None:  # the case really exercises its kernel
        assert any(type(kernel_for(m)) is kernel_type for m in covered)
    # 1. per-sample gradients (NTK rows) of every parameter, kernels + fallback, vs the dense Jacobian
    engine = JacobianRows(model, x)
    if name == "generic_fallback":
        assert set(engine.generic_names) == {"0.weight", "0.bias", "1.s"}
    cap = engine.capture(x)
    jac = torch.zeros(len(x) * C, engine.p, dtype=x.dtype, device=device)
    for lay in engine.layers:
        for (lo, hi), rows in engine.rows(cap, lay):
            assert rows.device.type == device
            jac[:, lo:hi] = rows
    for (lo, hi), rows in engine.generic_rows(x):
        jac[:, lo:hi] = rows
    dense = dense_refs.dense_jacobian(model, x)
    assert torch.allclose(jac, dense, rtol=1e-10, atol=1e-12)
    # 2. the NTK Gram: explicit and ghost contractions, held/streamed chunks, all on the device
    for method in ("explicit", "ghost"):
        for budget in (1 << 30, 6_000):
            gram = ntk_gram(model, x, memory_budget_bytes=budget, method=method)
            assert gram.device.type == device
            assert torch.allclose(gram, dense @ dense.T, rtol=1e-10, atol=1e-10 * float(dense.abs().max()) ** 2)
    # 3. squared sums (true-Fisher diagonal), layerwise kernels and the vmap fallback
    jl = dense_refs.dense_log_softmax_jacobian(model, x)
    model.eval()
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    model.train()
    for method in ("layerwise", "vmap"):
        got = fisher_diag(model, x, kind="true", method=method)
        for k, j in jl.items():   # j: (N, c, *shape)
            want = (p.reshape(*p.shape, *([1] * (j.ndim - 2))) * j * j).sum((0, 1)) / len(x)
            assert got[k].device.type == device
            assert torch.allclose(got[k], want, rtol=1e-9, atol=1e-14), (method, k)
    # 4. K-FAC uses exactly the factored kernels (their patches/output rows are what 1. verified)
    factored = {n for n, m in model.named_modules() if kernel_for(m) is not None and kernel_for(m).factored}
    assert set(kfac_layers(model)) == factored
    if factored:
        facs = compute_kfac(model, x, loss="ce")
        assert all(f.A.device.type == device and f.G.device.type == device for f in facs.values())


def test_registry_covers_the_documented_layers_once():
    types = [t for ts, _ in registered_kernels() for t in ts]
    assert nn.Linear in types and nn.Conv1d in types and nn.Conv2d in types
    assert nn.modules.batchnorm._BatchNorm in types
    assert len(types) == len(set(types))
    assert kernel_for(nn.Conv2d(2, 4, 3, groups=2)) is None            # not covered: fallback
    assert kernel_for(nn.Conv2d(2, 4, 3, padding="same")) is None
    assert kernel_for(nn.BatchNorm1d(3, track_running_stats=False)) is None
    assert kernel_for(nn.ReLU()) is None
