"""The stationarity check on a model whose minimiser is known in closed form: a linear model with MSE loss and
weight decay toward a centre c (ridge regression). At the exact minimiser the ratio is 0; judged with a wrong
centre or a wrong wd it is large, and the refusal names the pull."""
from __future__ import annotations

import pytest
import torch

from scrubnet.data.stream import as_stream
from scrubnet.recipe.objective import STATIONARITY_THRESHOLD, RecipeMismatch, check_stationarity, stationarity
from scrubnet.recipe import TrainingRecipe


def _ridge_model(c: torch.Tensor, wd: float, x, y):
    """nn.Linear(d, K, bias=False) at the minimiser of mean ½‖Wx − onehot(y)‖² + (wd/2)‖W − c‖²."""
    n, d = x.shape
    t = torch.nn.functional.one_hot(y, 3).double()
    a = x.double().T @ x.double() / n + wd * torch.eye(d, dtype=torch.float64)
    w = torch.linalg.solve(a, x.double().T @ t / n + wd * c.double().T).T
    m = torch.nn.Linear(d, 3, bias=False).double()
    with torch.no_grad():
        m.weight.copy_(w)
    return m


def test_ratio_is_zero_at_the_minimiser_and_large_for_a_wrong_centre():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 4, generator=g).double(), torch.randint(0, 3, (60,), generator=g)
    c = 3.0 * torch.randn(3, 4, generator=g).double()
    model = _ridge_model(c, 0.5, x, y)
    data = as_stream((x, y))
    right = TrainingRecipe(loss="mse", wd=0.5, wd_center={"weight": c})
    st = stationarity(model, data, right, {"weight": c})
    assert st.ratio < 1e-10
    wrong = TrainingRecipe(loss="mse", wd=0.5)                    # the model was pulled toward c, not 0
    st_w = stationarity(model, data, wrong, {"weight": torch.zeros_like(c)})
    assert st_w.ratio > STATIONARITY_THRESHOLD
    # the quadratic model is exact here: k ≥ rank steps of CG reach the Newton decrement = L_r(w) − min L_r
    ridge0 = _ridge_model(torch.zeros_like(c), 0.5, x, y)
    def obj(m):
        r = m(x).detach() - torch.nn.functional.one_hot(y, 3).double()
        return float(0.5 * (r ** 2).sum(1).mean() + 0.25 * (m.weight ** 2).sum().detach())
    st_full = stationarity(model, data, wrong, {"weight": torch.zeros_like(c)}, max_iter=12, early_stop=False,
                          tol=1e-12)
    assert st_full.decrement == pytest.approx(obj(model) - obj(ridge0), rel=1e-6)
    with pytest.raises(RecipeMismatch, match="weight decay"):
        check_stationarity(model, data, wrong, {"weight": torch.zeros_like(c)}, method="newton")
    pulled = TrainingRecipe(loss="mse", wd=0.5, wd_center={"weight": -c})
    with pytest.raises(RecipeMismatch, match="wd_center"):
        check_stationarity(model, data, pulled, {"weight": -c}, method="newton")
