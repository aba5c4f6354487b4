"""scrubnet.forget on hand-written models trained WITHOUT any pull (plain SGD + ordinary weight decay).

For every method: the forget readouts move toward the model retrained without D_f while the retain error rises by
at most a few points, or the call is refused / failed with its reason. The forget set is mislabelled samples the
original memorised (forget loss ≈ 0) and a retrained model gets wrong (forget loss ≫ 1), so "toward the retrain
model" is measurable on tiny models.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import scrubnet
from scrubnet import ScrubFailed, TrainingRecipe
from scrubnet.recipe.objective import RecipeMismatch
from tests.user_models import NormMLP, ResCNN, TinyViT, images, train_plain

WD = 5e-4
RECIPE = TrainingRecipe(wd=WD, lr=0.01, batch_size=32, epochs=5)
METHODS = ["finetune", "neggrad", "randomlabels", "fisher", "ntk", "ntk-fisher"]
EPOCHS = {"cnn": 30, "vit": 60, "mlp": 40}
CTORS = {"cnn": ResCNN, "vit": TinyViT, "mlp": NormMLP}


@pytest.fixture(scope="module")
def trained():
    """{kind: (original, retrained, retain, forget)}, each trained by plain SGD + weight decay 5e-4."""
    torch.manual_seed(0)
    x, y, fidx = images(150, 0, n_mislabelled=8)
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[fidx] = False
    out = {}
    for kind, ctor in CTORS.items():
        torch.manual_seed(0)
        m = train_plain(ctor(), x, y, epochs=EPOCHS[kind], lr=0.05, wd=WD)
        torch.manual_seed(0)
        r = train_plain(ctor(), x[keep], y[keep], epochs=EPOCHS[kind], lr=0.05, wd=WD)
        out[kind] = (m, r, (x[keep], y[keep]), (x[fidx], y[fidx]))
    return out


def _forget_loss(model, data):
    with torch.no_grad():
        return float(F.cross_entropy(model(data[0]), data[1]))


@pytest.mark.parametrize("kind", list(CTORS))
def test_every_method_moves_toward_retrain_or_says_why(trained, kind):
    original, retrained, retain, forget = trained[kind]
    lo, lr_ = _forget_loss(original, forget), _forget_loss(retrained, forget)
    assert lr_ > lo + 1.0  # the forget set is measurably different after retraining
    for method in METHODS:
        before = copy.deepcopy(original.state_dict())
        try:
            scrubbed, res = scrubnet.forget(original, retain, forget, method=method, recipe=RECIPE, readouts=True,
                                            on_failure="return")
        except RecipeMismatch as e:  # refused, with its reason
            assert "recipe" in str(e)
            continue
        assert all(torch.equal(before[k], v) for k, v in original.state_dict().items())  # input untouched
        ro = res.readouts
        if res.ok:
            assert ro["retain_error"] - ro["original_retain_error"] <= 0.05, (method, ro)
            assert ro["forget_loss"] > ro["original_forget_loss"], (method, ro)   # toward retrain (higher loss)
            assert abs(ro["forget_loss"] - lr_) < abs(lo - lr_), (method, ro)
        else:  # worse than its input only while saying so
            assert res.reasons, method


def test_result_worse_than_input_is_reported(trained):
    original, _, retain, forget = trained["mlp"]
    # a huge explicit noise scale destroys the model: the call must fail, not return silently
    with pytest.raises(ScrubFailed, match="retain error rose"):
        scrubnet.forget(original, retain, forget, method="fisher", recipe=RECIPE, alpha=1.0)
    _, res = scrubnet.forget(original, retain, forget, method="fisher", recipe=RECIPE, alpha=1.0, on_failure="return")
    assert not res.ok and res.report["retain_error_after"] > res.report["retain_error_before"] + 0.05


def test_newton_old_quick_start_context_is_refused_and_the_right_recipe_keeps_the_model(trained):
    original, retrained, retain, forget = trained["mlp"]
    torch.manual_seed(0)
    init = {k: v.detach().clone() for k, v in NormMLP().named_parameters()}  # "w_0" = a random initialisation
    old = TrainingRecipe(wd=0.03, wd_center=init)                            # the old quick start's objective
    with pytest.raises(RecipeMismatch, match="wd_center"):
        scrubnet.forget(original, retain, forget, method="newton", recipe=old)
    scrubbed, res = scrubnet.forget(original, retain, forget, method="newton", recipe=RECIPE, readouts=True,
                                    on_failure="return", tol=1e-3, max_iter=40)
    ro = res.readouts
    assert ro["retain_error"] - ro["original_retain_error"] <= 0.02        # not destroyed
    assert res.report["newton_data_rejections"] >= 0 and "stationarity_ratio" in res.report
    if res.ok:
        assert ro["forget_loss"] >= ro["original_forget_loss"] - 1e-3
    # forced, the wrong recipe's Newton step is caught by the data safeguard instead of wrecking the model
    _, forced = scrubnet.forget(original, retain, forget, method="newton", recipe=old, force=True, tol=1e-3,
                                max_iter=40, readouts=True, on_failure="return")
    assert forced.readouts["retain_error"] - forced.readouts["original_retain_error"] <= 0.02


def test_cg_at_its_cap_fails(trained):
    original, _, retain, forget = trained["mlp"]
    with pytest.raises(ScrubFailed, match="CG stopped after 3"):
        scrubnet.forget(original, retain, forget, method="newton", recipe=RECIPE, max_iter=3, tol=1e-12)
    _, res = scrubnet.forget(original, retain, forget, method="newton", recipe=RECIPE, max_iter=3, tol=1e-12,
                             on_failure="return")
    assert not res.ok and res.report["newton_cg_converged"] == 0.0


def test_noise_bound_against_a_reference(trained):
    original, retrained, retain, forget = trained["mlp"]
    _, res = scrubnet.forget(original, retain, forget, method="fisher", recipe=RECIPE, reference=retrained)
    assert res.noise is not None and res.bounds["info_weights_nats"] > 0
    assert res.report["retain_loss_increase"] <= 2 * res.report["retain_loss_budget"]


def test_dict_batches_from_a_dataloader_match_tensors(trained):
    original, _, retain, forget = trained["mlp"]
    ds = [{"image": x, "label": y} for x, y in zip(*retain)]
    loader = torch.utils.data.DataLoader(ds, batch_size=50)
    a, ra = scrubnet.forget(original, loader, forget, method="fisher", recipe=RECIPE, on_failure="return")
    b, rb = scrubnet.forget(original, retain, forget, method="fisher", recipe=RECIPE, on_failure="return")
    assert ra.report["alpha"] == pytest.approx(rb.report["alpha"], rel=1e-4)
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(v, w, atol=1e-5), k


def test_newton_through_scaled_dot_product_attention(trained):
    """Newton's Gauss–Newton products are JVPs through F.scaled_dot_product_attention (the math-kernel fallback)."""
    original, retrained, retain, forget = trained["vit"]
    _, res = scrubnet.forget(original, retain, forget, method="newton", recipe=RECIPE, tol=1e-3, max_iter=60,
                             readouts=True)
    ro = res.readouts
    assert res.ok and ro["retain_error"] - ro["original_retain_error"] <= 0.02
    assert abs(ro["forget_loss"] - _forget_loss(retrained, forget)) < abs(ro["original_forget_loss"]
                                                                          - _forget_loss(retrained, forget))
