"""The retain guard (scrubnet/training/guard.py): silent when the retain error holds, backs off and stops when it
rises; and, on a small token model handed over as DataLoaders of dict batches with an attention mask, no method
at its defaults raises or returns ok=True with the retain error risen past the tolerance."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import scrubnet
from scrubnet.data.stream import as_stream
from scrubnet.methods import available_methods, get_method
from scrubnet.methods.base import ForgetContext, method_class
from scrubnet.readouts.basic import stream_error_and_loss
from scrubnet.recipe import TrainingRecipe
from scrubnet.scrub import scrub_and_measure
from scrubnet.training.guard import RetainGuard, active_guard, guard_after_step, guard_scope

V, L, C = 20, 6, 3


class TokenNet(nn.Module):
    """Embedding, masked mean over the tokens, a hidden layer, a head: takes ``attention_mask`` as HF models do."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, C)

    def forward(self, input_ids, attention_mask=None):
        m = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        e = (self.emb(input_ids) * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp_min(1)
        return self.head(torch.relu(self.hidden(e)))


def _items(n: int, seed: int) -> list[dict]:
    """Token sequences whose class is the most frequent of three token groups; random padding at the end."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    ids = torch.randint(V, (n, L), generator=g)
    ids[:, :3] = (y[:, None] * 6 + torch.randint(6, (n, 3), generator=g)) % V
    lengths = torch.randint(4, L + 1, (n,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]).long()
    return [{"input_ids": ids[i] * mask[i], "attention_mask": mask[i], "labels": y[i]} for i in range(n)]


def _trained() -> tuple[nn.Module, list[dict]]:
    torch.manual_seed(0)
    model, items = TokenNet(), _items(240, 1)
    ids = torch.stack([d["input_ids"] for d in items])
    mask = torch.stack([d["attention_mask"] for d in items])
    y = torch.stack([d["labels"] for d in items])
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(2)
    for _ in range(40):
        for idx in torch.randperm(len(y), generator=g).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(ids[idx], mask[idx]), y[idx]).backward()
            opt.step()
    return model.eval(), items


RECIPE = TrainingRecipe(wd=5e-4, lr=0.2, momentum=0.9, batch_size=32, epochs=40)


@pytest.fixture(scope="module")
def trained():
    return _trained()


def _loaders(items, forget_class: int, key: str = "labels", test=None):
    loader = torch.utils.data.DataLoader
    retain = [d for d in items if int(d[key]) != forget_class]
    forget = [d for d in items if int(d[key]) == forget_class]
    return (loader(retain, batch_size=32), loader(forget, batch_size=32),
            loader(_items(90, 9) if test is None else test, batch_size=64))


def test_guard_is_silent_when_the_retain_error_holds(trained):
    model, items = trained
    retain, forget, _ = _loaders(items, 0)
    ctx = ForgetContext.from_recipe(model, RECIPE, num_classes=C, seed=0)
    method = get_method("finetune", epochs=2, lr=0.01)
    guarded = scrub_and_measure(method, model, retain, forget, ctx)
    plain = method(model, as_stream(retain), as_stream(forget), ctx)   # no guard active
    assert guarded.checks["retain_guard"]["backoffs"] == 0 and guarded.checks["retain_guard"]["checks"] >= 1
    assert all(torch.equal(a, b) for a, b in zip(guarded.model.parameters(), plain.model.parameters()))


def test_guard_puts_back_halves_and_stops_a_wrecking_run(trained):
    model, items = trained
    retain, forget, _ = _loaders(items, 0)
    ctx = ForgetContext.from_recipe(model, RECIPE, num_classes=C, seed=0)
    # NegGrad+ at a rate far too high, with momentum, β 0.5, the recipe's batch for both sets and no proximal term
    # (the former defaults: many small steps, nothing pulling back) to make sure it wrecks
    method = get_method("neggrad-plus", lr=3.0, epochs=3, beta=0.5, momentum=0.9, init_decay=0.0, batch_size=None,
                        forget_batch=None, forget_order="reshuffle", mode="train")
    err_in, _ = stream_error_and_loss(model, as_stream(retain))
    wrecked = method(model, as_stream(retain), as_stream(forget), ctx).model   # without the guard
    assert stream_error_and_loss(wrecked, as_stream(retain))[0] - err_in > 0.05
    out = scrub_and_measure(method, model, retain, forget, ctx)
    g = out.checks["retain_guard"]
    assert g["backoffs"] >= 1 and any(w.startswith("retain guard:") for w in out.warnings)
    assert out.report["retain_error_after"] - err_in <= 0.05


def test_guard_scope_checks_the_last_steps_and_restores(trained):
    """The slow twin of the guard's bookkeeping: steps that wreck the model after the last periodic check are
    undone when the scope ends (the weights of the last good check come back exactly)."""
    model, items = trained
    x = torch.stack([d["input_ids"] for d in items])
    mask = torch.stack([d["attention_mask"] for d in items])
    y = torch.stack([d["labels"] for d in items])
    from scrubnet.models.call import ModelInputs
    guard = RetainGuard([(ModelInputs(x, {"attention_mask": mask}), y)], 0.0, 0.05, check_every=100)
    guard.base_error = guard.error(model)
    net = _trained()[0]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    with active_guard(guard), guard_scope(net):
        for _ in range(3):   # push the head toward class 0 until the error is far past 5 points
            opt.zero_grad()
            (-10 * net(x, mask)[:, 0].mean()).backward()
            opt.step()
            guard_after_step(opt)
    assert guard.stopped and guard.checks == 1
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def _float_items(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    x = torch.randn(n, 6, generator=g) + 2.0 * nn.functional.one_hot(y, 6).float()
    return [{"features": x[i], "label": y[i]} for i in range(n)]


def _float_trained() -> tuple[nn.Module, list[dict]]:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(hidden=nn.Linear(6, 16), act=nn.ReLU(), head=nn.Linear(16, C)))
    items = _float_items(240, 3)
    x, y = torch.stack([d["features"] for d in items]), torch.stack([d["label"] for d in items])
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(2)
    for _ in range(40):
        for idx in torch.randperm(len(y), generator=g).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval(), items


#: the refusals by design: methods that move the inputs by their gradient (token ids cannot move), and
#: ML-Forgetting, which trains its own model family on the protocol's split
REFUSALS = {"boundary-shrink": "floating-point input", "unsir": "floating-point input",
            "mlforget": "does not scrub a user's model", "mlforget-retrain": "does not scrub a user's model"}


@pytest.mark.parametrize("kind", ["tokens", "features"])
def test_no_method_at_its_defaults_raises_on_dict_loaders_or_passes_a_wrecked_model(trained, kind):
    """Every registered method at its defaults on DataLoaders of dict batches (token ids with an attention
    mask; float features): none raises — except the input-perturbing methods' named refusal of token ids —
    and none returns ok=True with the retain error risen past the tolerance."""
    model, items = trained if kind == "tokens" else _float_trained()
    fc, tol = 1, 0.05
    retain, forget, test = _loaders(items, fc, "labels" if kind == "tokens" else "label",
                                    _items(90, 9) if kind == "tokens" else _float_items(90, 9))
    err_in, _ = stream_error_and_loss(model, as_stream(retain))
    seen = 0
    for name in available_methods():
        cls = method_class(name)
        call = dict(method=name, recipe=RECIPE, forget_class=fc, force=cls.uses_curvature, on_failure="return",
                    test=test, seed=0, retain_error_tolerance=tol)
        refusal = REFUSALS.get(name) if kind == "tokens" or name.startswith("mlforget") else None
        if refusal is not None:   # a named refusal of what the method cannot do, not a crash
            with pytest.raises(ValueError, match=refusal):
                scrubnet.forget(model, retain, forget, **call)
            continue
        _, res = scrubnet.forget(model, retain, forget, **call)
        rise = res.report["retain_error_after"] - err_in
        assert not (res.ok and rise > tol), (name, rise, res.reasons)
        seen += 1
    assert seen >= (14 if kind == "tokens" else 16)


class _Scripted(RetainGuard):
    """A guard whose probe errors are scripted (the bookkeeping alone, checked against a hand-written trace)."""

    def __init__(self, errors, **kw):
        super().__init__([], 0.10, 0.025, check_every=1, **kw)
        self.script = list(errors)

    def error(self, model):
        return self.script.pop(0)


def test_guard_lets_a_transient_rise_run_and_backs_off_a_wreck():
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    # step 1 good, step 2 a transient rise (+5 points < wreck 10), step 3 good again, step 4 a wreck (+30),
    # then the final check good: one back-off, the rate halved, the training not stopped
    guard = _Scripted([0.11, 0.15, 0.12, 0.40, 0.11])
    with active_guard(guard), guard_scope(net):
        for step in range(4):
            with torch.no_grad():
                net.weight += 1.0
            weights_before_wreck = net.weight.clone() if step == 2 else None
            guard_after_step(opt)
            if step == 2:
                kept = weights_before_wreck
    assert guard.backoffs == 1 and not guard.stopped and guard.progressed
    assert opt.param_groups[0]["lr"] == 0.5
    assert torch.equal(net.weight, kept)      # the wreck put back the weights of the last good check (step 3)
