"""A request's checks after its method ran: a whole-class request whose remaining classes' test error rises past
the tolerance is ``ok=False`` (whatever the verdict); the user's training is checked before it becomes a
yardstick; a profile's forget-set kind is checked at use."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import scrubnet
from scrubnet.recipe import TrainingRecipe
from scrubnet.tuning.check import check_trained, remaining_class_rule

C = 4


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    return torch.randn(n, 8, generator=g) + 2.0 * nn.functional.one_hot(y, 8).float(), y


def _trained():
    torch.manual_seed(0)
    m = nn.Sequential(OrderedDict(hidden=nn.Linear(8, 32), act=nn.ReLU(), head=nn.Linear(32, C)))
    x, y = _data(300, 0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return m.eval(), (x, y)


def test_a_class_request_that_breaks_the_remaining_classes_is_not_ok():
    model, (x, y) = _trained()
    test = _data(200, 1)
    keep = torch.nonzero(y != 0).flatten()[:9]
    retain, forget = (x[keep], y[keep]), (x[y == 0], y[y == 0])
    # a fine-tune that memorises a small D_r: the retain rule (and the guard) pass — retain error 0 — while the
    # remaining classes' test error rises (the GroupNorm CNN's case in the issue)
    _, wreck = scrubnet.forget(model, retain, forget, method="finetune", lr=0.5, epochs=60, test=test,
                               on_failure="return", on_not_forgotten="warn")
    assert wreck.checks["retain_error"]["passed"]
    chk = wreck.checks["remaining_test_error"]
    assert chk["class"] == 0 and chk["n"] == int((test[1] != 0).sum())
    # the check's numbers are the plain error on the held-out samples of classes 1..3, before and after
    rest = test[1] != 0
    with torch.no_grad():
        before = float((model(test[0][rest]).argmax(-1) != test[1][rest]).float().mean())
        after = float((wreck.model(test[0][rest]).argmax(-1) != test[1][rest]).float().mean())
    assert chk["before"] == pytest.approx(before) and chk["after"] == pytest.approx(after)
    assert after - before > 0.05, "the wrecking run must break the remaining classes for this test to mean anything"
    assert not wreck.ok and not chk["passed"] and any("remaining classes" in r for r in wreck.reasons)
    # a result every other check passed (the GroupNorm CNN's case: retain error held, test error rose) is
    # failed by this rule alone; the original model passes it
    from scrubnet.data.stream import as_stream

    def result(m):
        return type("R", (), {"ok": True, "reasons": [], "checks": {}, "scrub": type("S", (), {"model": m})()})()
    r = result(wreck.model)
    remaining_class_rule(r, model, as_stream(test), 0, 0.05)
    assert not r.ok and "broke the others" in r.reasons[0]
    r = result(model)
    remaining_class_rule(r, model, as_stream(test), 0, 0.05)
    assert r.ok and r.checks["remaining_test_error"]["passed"]
    remaining_class_rule(r, model, None, 0, 0.05)            # no held-out data: nothing measured


def test_the_users_training_is_checked_before_it_becomes_a_yardstick():
    model, (x, y) = _trained()
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, C))
    with pytest.raises(ValueError, match="another architecture"):
        check_trained(other, model, x[:4])
    nan = _trained()[0]
    with torch.no_grad():
        nan.head.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        check_trained(nan, model, x[:4])
    with pytest.raises(ValueError, match="not the trained nn.Module"):
        check_trained(None, model, x[:4])
    check_trained(_trained()[0], model, x[:4])      # the same architecture, finite: accepted


def _profile(model, gold_forget_loss: float, test_loss: float, chosen: dict, n: int):
    from scrubnet.checkpoint import weights_sha256
    from scrubnet.tuning.profile import TunedProfile
    draw = {"n": n, "class": None, "gold": {"forget_loss": gold_forget_loss}, "original": {"test_loss": test_loss},
            "classes": {}}
    return TunedProfile(model_sha256=weights_sha256(model), original={"test_loss": test_loss}, trials=[],
                        validation={"n": n, "class": None, "classes": {}, "retrain_seconds": 1.0,
                                    "gold": draw["gold"], "draws": [draw, draw]},
                        tolerance=0.05, min_closure=0.5, chosen=chosen)


def test_a_request_checks_itself_against_the_profiles_promise_and_takes_the_next_step():
    from scrubnet.tuning.check import per_sample_loss
    from scrubnet.tuning.request import estimated_closure
    from scrubnet.data.stream import as_stream
    model, (x, y) = _trained()
    test = _data(200, 1)
    retain, forget = (x[20:], y[20:]), (x[:20], y[:20])
    lf0 = float(per_sample_loss(model, as_stream(forget)).mean())
    lt0 = float(per_sample_loss(model, as_stream(test)).mean())
    # the promise: the retraining's forget loss was 3× the original's test loss on the validation draws
    weak = {"method": "finetune", "options": {"epochs": 1, "lr": 1e-6}}           # moves nothing
    strong = {"method": "neggrad", "options": {"epochs": 3, "lr": 0.05}}
    prof = _profile(model, 3.0, 1.0, dict(weak, within=True, why="test", closure_worst=0.6, next=[
        dict(strong, closure_worst=0.5)]), 20)
    # a tiny model: the call's fixed costs (the verdict, the retain rule) are many of its 10 ms retrainings; the
    # ceiling is raised so that the next step fits
    _, res = scrubnet.forget(model, retain, forget, method="auto", profile=prof, test=test, on_failure="return",
                             on_not_forgotten="warn", max_cost_vs_retrain=1e4)
    sc = res.checks["self_check"]
    assert sc["promised_gold_forget_loss"] == pytest.approx(3.0 * lt0, rel=1e-5)
    assert sc["original_forget_loss"] == pytest.approx(lf0, rel=1e-5)
    first, second = sc["attempts"]
    assert first["method"] == "finetune" and first["estimated_closure"] < 0.5          # fell short
    assert first["estimated_closure"] == pytest.approx(
        estimated_closure(first["forget_loss"], lf0, 3.0 * lt0), abs=1e-9)
    assert second["method"] == "neggrad"                                             # the next step ran
    assert res.method == ("neggrad" if second["estimated_closure"] >= 0.5 and second["ok"] else res.method)
    assert sc["total_cost_vs_retrain"] == pytest.approx(first["cost_vs_retrain"] + second["cost_vs_retrain"])
    assert any("next step" in w for w in res.warnings)

    # a next step predicted past the cost ceiling is not run; nothing reached the promise: the routes are named
    long = {"method": "neggrad", "options": {"epochs": 10 ** 6, "lr": 0.05}, "closure_worst": 0.5}
    prof = _profile(model, 3.0, 1.0, dict(weak, within=True, why="test", closure_worst=0.6, next=[long]), 20)
    _, res = scrubnet.forget(model, retain, forget, method="auto", profile=prof, test=test, on_failure="return",
                             on_not_forgotten="warn", max_cost_vs_retrain=1e4)
    assert len(res.checks["self_check"]["attempts"]) == 1 and not res.checks["self_check"]["kept"]
    routes = [w for w in res.warnings if "routes that forget" in w]
    assert routes and "retrain" in routes[0] and "forgettable" in routes[0]
    assert estimated_closure(1.0, 1.0, 1.01) == 1.0 and estimated_closure(1.2, 1.0, 1.01) == 0.0   # no gap
    assert estimated_closure(2.0, 1.0, 3.0) == pytest.approx(0.5)
