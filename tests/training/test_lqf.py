"""LQF: K-FAC-preconditioned training and the leave-one-out influence against actual retraining."""
import pytest
import torch
from torch import nn

from scrubnet.training.lqf import (
    LQFConfig,
    full_loss,
    influence_on_prediction,
    lqf_model,
    solve_lqf,
    train_lqf,
)


def problem(net, n=30, d=5, c=3, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(n, d, dtype=torch.float64)
    y = torch.randint(0, c, (n,))
    xt = torch.randn(4, d, dtype=torch.float64)
    return net.double(), x, y, xt


def retrain_delta_f(start, x, y, xt, i, cfg, c):
    full, _ = solve_lqf(start, x, y, c, cfg)
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[i] = False
    loo, _ = solve_lqf(start, x[keep], y[keep], c, cfg)
    with torch.no_grad():
        return full, full(xt) - loo(xt)


@pytest.mark.parametrize("inverse", ["cg", "kfac"])
def test_influence_equals_retraining_on_a_linear_model(inverse):
    torch.manual_seed(0)
    start, x, y, xt = problem(nn.Linear(5, 3))
    cfg = LQFConfig(wd=0.05, leaky_slope=None)
    for i in (0, 7):
        full, expected = retrain_delta_f(start, x, y, xt, i, cfg, 3)
        got = influence_on_prediction(full, x, y, i, xt, cfg, 3, inverse=inverse)
        assert float(expected.abs().max()) > 1e-2  # a real effect
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def test_influence_equals_retraining_on_a_linearised_mlp():
    torch.manual_seed(1)
    start, x, y, xt = problem(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), n=25)
    cfg = LQFConfig(wd=0.05, leaky_slope=0.1)
    full, expected = retrain_delta_f(start, x, y, xt, 3, cfg, 3)
    got = influence_on_prediction(full, x, y, 3, xt, cfg, 3, inverse="cg")
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    # K-FAC is only an approximation with two layers: same sign pattern, rough magnitude
    approx = influence_on_prediction(full, x, y, 3, xt, cfg, 3, inverse="kfac")
    assert float(torch.nn.functional.cosine_similarity(approx.reshape(1, -1), expected.reshape(1, -1))) > 0.5
    with pytest.raises(ValueError):
        influence_on_prediction(full, x, y, 99, xt, cfg, 3)


def test_kfac_sgd_is_a_newton_step_on_one_layer():
    torch.manual_seed(2)
    start, x, y, _ = problem(nn.Linear(5, 3), n=40)
    base = dict(wd=0.05, leaky_slope=None, lr=1.0, momentum=0.0, epochs=1, batch_size=40)
    opt, _ = solve_lqf(start, x, y, 3, LQFConfig(**base))
    best = full_loss(opt, x, y, LQFConfig(**base), 3)
    model, hist = train_lqf(start, x, y, 3, LQFConfig(**base, optimizer="kfac"))
    assert hist[-1] - best < 1e-9 * abs(best)  # full-batch K-FAC step with lr 1 = exact Newton step
    _, hist_sgd = train_lqf(start, x, y, 3, LQFConfig(**{**base, "lr": 0.1}, optimizer="sgd"))
    assert hist_sgd[-1] - best > 1e-3
    _, hist_adam = train_lqf(start, x, y, 3, LQFConfig(**{**base, "lr": 0.05, "epochs": 30}, optimizer="adam"))
    assert hist_adam[-1] < hist_adam[0]


def test_lqf_model_defaults_and_validation():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    m = lqf_model(net, LQFConfig())
    assert isinstance(m.base[1], nn.LeakyReLU)
    with pytest.raises(ValueError):
        LQFConfig(optimizer="lbfgs")
    with pytest.raises(ValueError):
        LQFConfig(wd=0)
