"""Every registered method on every model of the zoo (tests/zoo.py): it runs — a finite model with the same
state_dict keys, the input model untouched — or refuses with ONE line naming a cause that is not the
architecture (a missing protocol input, integer inputs for a method that moves the inputs). Tiny instances
(8 samples), iterations capped, so the whole grid stays within about a minute of CPU.

Which refusal is allowed where is written out in ``ALLOWED_REFUSALS``: any other exception, or a refusal on a
(method, model) pair not listed, fails the test — so a crash in a code path that indexes ``x`` as a tensor,
calls ``model(x)`` directly or vmaps over mask code shows up here.
"""
import re

import pytest
import torch

import scrubnet
from scrubnet.methods.base import available_methods
from scrubnet.recipe import TrainingRecipe
from tests import zoo

pytest.importorskip("transformers")

N = 8
RECIPE = TrainingRecipe(wd=1e-2, epochs=1, batch_size=4)
#: iteration caps (the grid's cost) and settings that make a method do something on 8 samples
OPTIONS = {"newton": dict(max_iter=20), "ntk": dict(cg_max_iter=50), "ntk-fisher": dict(cg_max_iter=50),
           "neggrad-plus": dict(epochs=1), "l1-sparse": dict(epochs=1), "salun": dict(epochs=1),
           "scrub": dict(epochs=1), "boundary-shrink": dict(epochs=1), "unsir": dict(noise_steps=2),
           "finetune": dict(epochs=1), "neggrad": dict(epochs=1), "randomlabels": dict(epochs=1),
           "ssd": dict(selection_threshold=1.0)}
#: the methods that forget a whole class (run with forget_class=0, D_f = that class)
CLASS_METHODS = {"hiding", "unsir", "boundary-shrink"}
INT_INPUTS = {"lstm", "gru", "bert"}          # token ids: nothing a gradient can move
#: the classifier of the zoo models whose head is not under head / fc / classifier
HEADS = {"dict_output": "net.3", "nested": "body.classifier"}
#: (method, model) → the cause a refusal must name; models None = every model
ALLOWED_REFUSALS = [
    ("mlforget", None, r"own mixed-linear model family.*does not scrub a user's model"),
    ("mlforget-retrain", None, r"own mixed-linear model family.*does not scrub a user's model"),
    ("unsir", INT_INPUTS, r"needs floating-point input tensors.*(dtype torch\.int64|main input has dtype)"),
    ("boundary-shrink", INT_INPUTS, r"needs floating-point input tensors.*(dtype torch\.int64|main input has dtype)"),
    ("hiding", set(HEADS), r"classifier=NAME"),
]
#: words of a crash about layers or autodiff, never allowed in a refusal
ARCHITECTURE = re.compile(r"vmap|functional_call|jvp|forward-mode|not implemented|NotImplemented|attribute|"
                          r"unsupported|Expected .* dtype|size mismatch|must match the size", re.I)


def allowed(method, name):
    for m, models, pattern in ALLOWED_REFUSALS:
        if m == method and (models is None or name in models):
            return pattern
    return None


def data(name):
    model, x = zoo.build(name, n=N)
    y = torch.arange(N) % zoo.C
    return model, x, y


def split(method, x, y):
    if method in CLASS_METHODS:
        f = y == 0
        return (x[~f], y[~f]), (x[f], y[f]), {"forget_class": 0}
    return (x[:6], y[:6]), (x[6:], y[6:]), {}


def run(method, name, model, x, y, **extra):
    retain, forget, kw = split(method, x, y)
    return scrubnet.forget(model, retain, forget, method=method, recipe=RECIPE, force=True, on_failure="return",
                           retain_error_tolerance=1.0, **OPTIONS.get(method, {}), **kw, **extra)


def check_runs(model, before, got, res):
    assert list(got.state_dict()) == list(model.state_dict())
    for k, v in got.state_dict().items():
        if v.is_floating_point():
            assert torch.isfinite(v).all(), k
    for k, v in model.state_dict().items():   # the input model is untouched
        assert torch.equal(v, before[k]), k
    for r in res.reasons:                      # a failed scrub says why in one line, not about layers
        assert "\n" not in r and not ARCHITECTURE.search(r), r


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
@pytest.mark.parametrize("method", available_methods())
def test_every_method_runs_or_refuses_for_a_named_cause(method, name):
    model, x, y = data(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pattern = allowed(method, name)
    try:
        got, res = run(method, name, model, x, y)
    except ValueError as e:
        msg = str(e)
        assert pattern is not None, f"{method} on {name} refused: {msg}"
        assert "\n" not in msg and re.search(pattern, msg), msg
        assert not ARCHITECTURE.search(msg), msg
        if method == "hiding":                 # named, the nested head works
            got, res = run(method, name, model, x, y, classifier=HEADS[name])
            check_runs(model, before, got, res)
            assert res.ok, res.reasons
        return
    assert pattern is None, f"{method} on {name} ran though a refusal was expected"
    check_runs(model, before, got, res)
    if method not in ("ssd",):                 # SSD may honestly select nothing on 8 samples
        assert res.ok, res.reasons


def test_the_grid_covers_the_registered_methods():
    # a new method joins the grid by registering; its caps belong in OPTIONS when it iterates
    assert {"fisher", "newton", "ntk", "ntk-fisher", "finetune", "neggrad", "randomlabels", "hiding", "retrain",
            "original", "neggrad-plus", "l1-sparse", "salun", "scrub", "ssd", "bad-teacher", "unsir",
            "boundary-shrink"} <= set(available_methods())
