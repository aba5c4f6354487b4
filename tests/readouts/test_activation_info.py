"""The black-box (activation) bound against hand-computed Gaussian KLs on 2-output examples."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from scrubnet.readouts.activation_info import (activation_information, activation_information_sets,
                                               activation_moments, gaussian_kl_diag_code, gaussian_kl_full)

D64 = torch.float64


def test_full_kl_hand_values():
    # N((0,0), I) ‖ N((1,0), diag(2,1)):  ½[(½ + 1) + ½ − 2 + ln 2] = ½ ln 2
    kl = gaussian_kl_full(torch.tensor([[0.0, 0.0]], dtype=D64), torch.eye(2, dtype=D64)[None],
                          torch.tensor([[1.0, 0.0]], dtype=D64), torch.diag(torch.tensor([2.0, 1.0], dtype=D64))[None])
    assert float(kl) == pytest.approx(0.5 * math.log(2), rel=1e-12)
    # correlated: N(0, [[2,1],[1,2]]) ‖ N((1,1), I):  ½[4 + 2 − 2 + ln(1/3)]
    kl = gaussian_kl_full(torch.zeros(1, 2, dtype=D64), torch.tensor([[[2.0, 1.0], [1.0, 2.0]]], dtype=D64),
                          torch.ones(1, 2, dtype=D64), torch.eye(2, dtype=D64)[None])
    assert float(kl) == pytest.approx(0.5 * (4 - math.log(3)), rel=1e-12)
    # identical distributions: 0
    cov = torch.tensor([[[1.5, 0.3], [0.3, 0.7]]], dtype=D64)
    assert float(gaussian_kl_full(torch.ones(1, 2, dtype=D64), cov, torch.ones(1, 2, dtype=D64), cov)) == \
        pytest.approx(0.0, abs=1e-12)


def test_diag_code_hand_value():
    # Σ_k [(Δ_k)²/v_q + v_p/v_q − ln(v_p/v_q) − 1], no ½: k=1: 1/2 + 1/2 − ln ½ − 1; k=2: 4/1 + 3 − ln 3 − 1
    got = gaussian_kl_diag_code(torch.tensor([[0.0, 0.0]], dtype=D64), torch.tensor([[1.0, 3.0]], dtype=D64),
                                torch.tensor([[1.0, 2.0]], dtype=D64), torch.tensor([[2.0, 1.0]], dtype=D64))
    want = (0.5 + 0.5 + math.log(2) - 1) + (4 + 3 - math.log(3) - 1)
    assert float(got) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError):
        gaussian_kl_diag_code(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))


class _Lin(nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.head = nn.Linear(2, 2)
        with torch.no_grad():
            self.head.weight.copy_(w)
            self.head.bias.copy_(b)

    def forward(self, x):
        return self.head(x)


def test_through_a_linear_two_output_network():
    """f(x) = W x + b: ∂f_k/∂W_kj = x_j, ∂f_k/∂b_k = 1, so Σ(x) = diag_k(Σ_j v_{W,kj} x_j² + v_{b,k})."""
    ws = torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=D64)
    bs = torch.tensor([0.1, -0.2], dtype=D64)
    wr = torch.tensor([[0.8, -1.0], [0.5, 1.5]], dtype=D64)
    br = torch.tensor([0.0, 0.3], dtype=D64)
    model = _Lin(ws, bs).double()
    mean_s = {"head.weight": ws, "head.bias": bs}
    mean_r = {"head.weight": wr, "head.bias": br}
    var_s = {"head.weight": torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=D64), "head.bias": torch.tensor([0.05, 0.1], dtype=D64)}
    var_r = {"head.weight": torch.tensor([[0.2, 0.2], [0.1, 0.5]], dtype=D64), "head.bias": torch.tensor([0.1, 0.1], dtype=D64)}
    x = torch.tensor([[1.0, 2.0], [-0.5, 0.3]], dtype=D64)
    f, cov = activation_moments(model, mean_s, var_s, x)
    assert torch.allclose(f, x @ ws.T + bs)
    for i in range(2):
        for k in range(2):
            v = float((var_s["head.weight"][k] * x[i] ** 2).sum() + var_s["head.bias"][k])
            assert float(cov[i, k, k]) == pytest.approx(v, rel=1e-12)
        assert float(cov[i, 0, 1]) == pytest.approx(0.0, abs=1e-14)
    per = activation_information(model, mean_s, var_s, model, mean_r, var_r, x)
    for i in range(2):
        fs, fr = x[i] @ ws.T + bs, x[i] @ wr.T + br
        vs = [(var_s["head.weight"][k] * x[i] ** 2).sum() + var_s["head.bias"][k] for k in range(2)]
        vr = [(var_r["head.weight"][k] * x[i] ** 2).sum() + var_r["head.bias"][k] for k in range(2)]
        want = 0.5 * sum(float(vs[k] / vr[k] + (fr[k] - fs[k]) ** 2 / vr[k] - 1 + torch.log(vr[k] / vs[k]))
                         for k in range(2))
        assert float(per[i]) == pytest.approx(want, rel=1e-10)
    code = activation_information(model, mean_s, var_s, model, mean_r, var_r, x, form="diag_code")
    assert torch.allclose(code, 2 * per, rtol=1e-10)  # diagonal Σ: the code's value is 2·KL
    sets = activation_information_sets(model, mean_s, var_s, model, mean_r, var_r, {"forget": x, "test": x[:1]})
    assert sets["info_activations_nats_forget"] == pytest.approx(float(per.mean()), rel=1e-12)
    assert sets["info_activations_nats_test"] == pytest.approx(float(per[0]), rel=1e-12)
    assert sets["info_activations_nats_forget_code"] == pytest.approx(2 * float(per.mean()), rel=1e-10)
    # the model whose architecture is borrowed is left untouched
    assert torch.equal(model.head.weight.detach(), ws)
    with pytest.raises(ValueError):
        activation_information(model, mean_s, var_s, model, mean_r, var_r, x, form="nope")
    with pytest.raises(ValueError):
        activation_moments(model, {"head.weight": ws}, var_s, x)
