"""Recipes as users train: label smoothing and the MSE target scale in every gradient, AdamW's decoupled decay,
a state_dict as the centre file, and the stationarity check on over- and under-stated decay and on unconverged
models (docs/decisions/recipes.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from scrubnet.curvature.ggn import mean_loss_and_grad
from scrubnet.data.stream import as_stream
from scrubnet.methods.ntk import residuals
from scrubnet.recipe import TrainingRecipe
from scrubnet.recipe.adamw import adamw_l2_equivalent
from scrubnet.recipe.objective import RecipeMismatch, check_stationarity, stationarity
from scrubnet.training import batch_loss

C = 3


def _data(n=90, d=5, seed=0, noise=1.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % C
    x = torch.randn(C, d, generator=torch.Generator().manual_seed(7))[y] + noise * torch.randn(n, d, generator=g)
    return x.double(), y


def test_label_smoothing_gradient_is_the_closed_form():
    x, y = _data()
    model = nn.Linear(5, C, bias=False).double()
    for eps in (0.0, 0.2):
        spec = TrainingRecipe(label_smoothing=eps).loss_spec
        loss, g = mean_loss_and_grad(model, x, y, loss=spec)
        p = torch.softmax(model(x).detach(), 1)
        t = (1 - eps) * F.one_hot(y, C).double() + eps / C
        assert g.reshape(C, 5) == pytest.approx((p - t).T @ x / len(y), abs=1e-12)
        assert loss == pytest.approx(float(-(t * p.log()).sum(1).mean()), rel=1e-12)
        assert residuals(model(x).detach(), y, "ce", C, label_smoothing=eps) == pytest.approx(p - t, abs=1e-12)
        assert float(batch_loss(model(x), y, spec).detach()) == pytest.approx(loss, rel=1e-12)
    # the MSE target scale: ∇ = (f − s·onehot) xᵀ / N
    spec = TrainingRecipe(loss="mse", target_scale=4.0).loss_spec
    _, g = mean_loss_and_grad(model, x, y, loss=spec)
    r = model(x).detach() - 4.0 * F.one_hot(y, C).double()
    assert g.reshape(C, 5) == pytest.approx(r.T @ x / len(y), abs=1e-12)
    with pytest.raises(ValueError, match="cross-entropy loss only"):
        TrainingRecipe(loss="mse", label_smoothing=0.1)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, C)).double()


def _fit(model, x, y, recipe, steps=None):
    """Full-batch L-BFGS on the recipe's objective to convergence, or ``steps`` plain GD steps (lr 0.1)."""
    params = list(model.parameters())

    def objective():
        return recipe.loss_fn(model(x), y) + 0.5 * recipe.wd * sum((p ** 2).sum() for p in params)

    if steps is not None:
        opt = torch.optim.SGD(params, lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            objective().backward()
            opt.step()
        return model
    opt = torch.optim.LBFGS(params, lr=1, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    opt.step(closure)
    return model


@pytest.fixture(scope="module")
def fitted():
    x, y = _data()
    return x, y, {wd: _fit(_mlp(), x, y, TrainingRecipe(wd=wd)) for wd in (1e-3, 0.1)}


def test_check_accepts_converged_and_refuses_a_misstated_decay(fitted):
    x, y, models = fitted
    data = as_stream((x, y))
    for wd, m in models.items():
        st = check_stationarity(m, data, TrainingRecipe(wd=wd), TrainingRecipe(wd=wd).center_for(m), method="newton")
        assert st.ratio < 1e-6 and st.converged
    for trained, stated, cause in ((0.1, 1e-3, "stronger"), (0.1, 1e-2, "stronger"), (1e-3, 0.1, "not balanced"),
                                   (1e-3, 1e-2, "not balanced")):
        r = TrainingRecipe(wd=stated)
        with pytest.raises(RecipeMismatch, match=cause):
            check_stationarity(models[trained], data, r, r.center_for(models[trained]), method="newton")
    st = stationarity(models[0.1], data, TrainingRecipe(wd=1e-3), TrainingRecipe().center_for(models[0.1]))
    assert st.implied_wd == pytest.approx(0.1, rel=0.05) and st.alignment > 0.99


def test_check_refuses_an_unconverged_model():
    x, y = _data()
    r = TrainingRecipe(wd=1e-3)
    for steps in (15, 40):
        m = _fit(_mlp(), x, y, r, steps=steps)
        with pytest.raises(RecipeMismatch, match="convergence"):
            check_stationarity(m, as_stream((x, y)), r, r.center_for(m), method="newton")


def test_label_smoothing_and_target_scale_are_used_by_the_check():
    x, y = _data()
    smooth = TrainingRecipe(wd=1e-2, label_smoothing=0.2)
    m = _fit(_mlp(), x, y, smooth)
    data = as_stream((x, y))
    assert check_stationarity(m, data, smooth, smooth.center_for(m), method="newton").ratio < 1e-6
    with pytest.raises(RecipeMismatch):
        check_stationarity(m, data, TrainingRecipe(wd=1e-2), None, method="newton")
    scaled = TrainingRecipe(loss="mse", wd=1e-2, target_scale=5.0)   # an LQF-style model at its exact optimum
    m = _fit(_mlp(), x, y, scaled)
    assert check_stationarity(m, data, scaled, scaled.center_for(m), method="ntk").ratio < 1e-6


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.head = nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, C)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc1(x))))


def test_a_state_dict_with_buffers_is_a_centre_file(tmp_path):
    model = _BNNet()
    model.train()(torch.randn(8, 5))                      # running stats and num_batches_tracked move
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "w0.safetensors")
    (tmp_path / "r.toml").write_text('[recipe]\nwd = 0.01\nwd_center = "w0.safetensors"\n')
    recipe = TrainingRecipe.from_toml(tmp_path / "r.toml")
    center = recipe.center_for(model)
    assert set(center) == {k for k, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(center[k], p.detach()) for k, p in model.named_parameters() if k in center)
    bad = TrainingRecipe(wd=0.01, wd_center={**recipe.wd_center, "nothere.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="nothere.weight"):
        bad.center_for(model)


def _adamw_model(x, y, wd, groups=False):
    """A small MLP trained by minibatch AdamW with a cosine schedule to 0 (the usual fine-tuning recipe)."""
    m = _mlp(1)
    params = ([{"params": [p for n, p in m.named_parameters() if "bias" not in n], "weight_decay": wd},
               {"params": [p for n, p in m.named_parameters() if "bias" in n], "weight_decay": 0.0}]
              if groups else m.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 600)
    g = torch.Generator().manual_seed(0)
    for _ in range(600):
        idx = torch.randint(0, len(y), (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(m(x[idx]), y[idx]).backward()
        opt.step()
        sched.step()
    return m, opt


def test_adamw_is_stated_by_its_l2_equivalent():
    x, y = _data()
    m, opt = _adamw_model(x, y, 0.5, groups=True)
    wd, decayed, info = adamw_l2_equivalent(m, opt)
    # the closed form: Σ κ w² / Σ w² with κ = λ(√v̂ + ε) over the decayed parameters
    num = den = 0.0
    for p in opt.param_groups[0]["params"]:
        st = opt.state[p]
        v_hat = st["exp_avg_sq"] / (1 - 0.999 ** float(st["step"]))
        num += float((0.5 * (v_hat.sqrt() + 1e-8) * p.detach() ** 2).sum())
        den += float((p.detach() ** 2).sum())
    assert wd == pytest.approx(num / den, rel=1e-9) and wd < 0.05 * 0.5
    assert decayed == {"0.weight", "2.weight"} and info["weight_decay"] == 0.5
    recipe = TrainingRecipe.from_adamw(m, opt, label_smoothing=0.0)
    assert recipe.wd == wd and set(recipe.wd_center) == decayed and recipe.center_is_zero
    data = as_stream((x, y))
    naive = TrainingRecipe(wd=0.5, wd_center=recipe.wd_center)   # AdamW's weight_decay stated as recipe.wd
    with pytest.raises(RecipeMismatch, match="from_adamw"):
        check_stationarity(m, data, naive, naive.center_for(m), method="newton")
    assert stationarity(m, data, recipe, recipe.center_for(m)).ratio < \
        stationarity(m, data, naive, naive.center_for(m), early_stop=False).ratio
    m0, opt0 = _adamw_model(x, y, 0.0)
    assert TrainingRecipe.from_adamw(m0, opt0).wd == 0.0 and TrainingRecipe.from_adamw(m0, opt0).wd_center is None
