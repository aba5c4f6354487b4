"""scrubnet.tuning: validation forget sets drawn like D_f, one retraining with the user's own function, the
tuned profile (JSON round trip, bound to the weights) and ``forget(method="auto")`` running what it chose."""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import scrubnet
from scrubnet.recipe import TrainingRecipe
from scrubnet.tuning.data import cut, draw_like, join, labels_of
from scrubnet.tuning.profile import TunedProfile, candidate_grid, method_rates
from scrubnet.tuning.tune import evaluate, forget_closure, tune
from scrubnet.tuning.data import stream

C = 4
RECIPE = TrainingRecipe(wd=5e-4, lr=0.1, momentum=0.9, batch_size=32, epochs=20)


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 1.5 * nn.functional.one_hot(y, 8).float()
    return x, y


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(hidden=nn.Linear(8, 32), act=nn.ReLU(), head=nn.Linear(32, C)))


def user_train(model: nn.Module, data) -> nn.Module:
    """The user's own training: re-initialise, SGD + momentum + weight decay, seeded batches."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=RECIPE.lr, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(2)
    for _ in range(RECIPE.epochs):
        for idx in torch.randperm(len(y), generator=g).split(RECIPE.batch_size):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def setup():
    x, y = _data(400, 0)
    forget_idx = torch.arange(8)          # a 2 % random forget set
    keep = torch.arange(8, 400)
    model = user_train(_net(), (x, y))
    return model, (x[keep], y[keep]), (x[forget_idx], y[forget_idx]), _data(200, 5)


def test_validation_sets_are_drawn_like_the_forget_set_and_disjoint_from_it():
    y_r = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 1])
    y_f = torch.tensor([0, 0, 2])
    idx, cls = draw_like(y_r, y_f, seed=3)
    assert cls is None and sorted(y_r[idx].tolist()) == [0, 0, 2]     # positions in D_r: disjoint from D_f
    idx, cls = draw_like(torch.tensor([0, 0, 1, 1, 1, 2, 2]), torch.tensor([3, 3]), seed=0, whole_class=3)
    assert cls in (0, 2) and idx.tolist() == ([0, 1] if cls == 0 else [5, 6])  # a whole class of the same size
    ds = torch.utils.data.TensorDataset(*_data(10, 1))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)
    part = cut(loader, torch.tensor([1, 3]))
    assert isinstance(part, torch.utils.data.DataLoader) and part.batch_size == 4
    assert labels_of(join(part, ds)).tolist() == ds.tensors[1][[1, 3]].tolist() + ds.tensors[1].tolist()
    from scrubnet.tuning.data import fresh
    order = lambda dl: torch.cat([b[1] for b in dl]).tolist()   # noqa: E731
    first = order(fresh(loader, 3))
    assert order(fresh(loader, 3)) == first        # every run sees the same order, whatever ran before


def test_rates_scale_to_the_training_and_an_adamw_rate_is_never_an_sgd_rate():
    assert method_rates(RECIPE) == (0.1, 0.001)
    adamw = TrainingRecipe(lr=1e-3, epochs=40, optimizer="adamw") if "optimizer" in \
        TrainingRecipe.__dataclass_fields__ else None
    if adamw is not None:
        sgd, adam = method_rates(adamw)
        assert adam == 1e-3 and sgd == pytest.approx(0.01)
    grid = candidate_grid("neggrad", RECIPE, budget=4)
    assert grid == [{"epochs": 5, "lr": 0.1 / 3}, {"epochs": 2, "lr": 0.1 / 3}, {"epochs": 5, "lr": 0.1},
                    {"epochs": 5, "lr": 0.1 * 0.1}]


def test_tune_measures_against_the_users_retraining_and_auto_runs_the_choice(setup, tmp_path):
    model, retain, forget, test = setup
    prof = tune(model, retain, forget, train=user_train, test=test, recipe=RECIPE, seed=0,
                methods=("finetune", "neggrad"), budget=2, draws=1)
    # the gold is the user's function on D ∖ V (V drawn from D_r, D_f kept), evaluated on the same sets
    idx_v, _ = draw_like(retain[1], forget[1], 0)
    keep = torch.ones(len(retain[1]), dtype=torch.bool)
    keep[idx_v] = False
    gold = user_train(copy.deepcopy(model), (torch.cat([retain[0][keep], forget[0]]),
                                             torch.cat([retain[1][keep], forget[1]])))
    v = stream((retain[0][idx_v], retain[1][idx_v]))
    assert prof.validation["n"] == len(forget[1])
    assert prof.validation["gold"]["forget_error"] == evaluate(gold, v, v, stream(test))["forget_error"]
    assert len(prof.trials) == 4 and prof.validation["retrain_seconds"] > 0
    assert forget_closure(prof.original, prof.original, prof.validation["gold"]) == 0.0
    assert forget_closure(prof.validation["gold"], prof.original, prof.validation["gold"]) == 1.0
    inside = [t for t in prof.trials if t.within]
    if inside:
        assert prof.chosen["within"] and prof.method == min(inside, key=lambda t: t.seconds).method
    path = tmp_path / "profile.json"
    prof.save(path)
    again = TunedProfile.load(path)
    assert again.chosen == prof.chosen and len(again.trials) == len(prof.trials)
    a, res = scrubnet.forget(model, retain, forget, method="auto", profile=path, recipe=RECIPE, on_failure="return")
    b, _ = scrubnet.forget(model, retain, forget, method=prof.method, recipe=RECIPE, on_failure="return",
                           **prof.options)
    assert res.checks["auto"]["method"] == prof.method
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert sum(line.startswith("  ") for line in prof.summary()) == 4 and "below 0" in "".join(prof.summary())
    with pytest.raises(ValueError, match="other weights"):
        scrubnet.forget(_net(), retain, forget, method="auto", profile=prof, recipe=RECIPE)
    with pytest.raises(ValueError, match="tuned profile"):
        scrubnet.forget(model, retain, forget, method="auto", recipe=RECIPE)


def test_a_refused_curvature_method_names_what_to_do_instead(setup):
    _, retain, forget, _ = setup
    from scrubnet.recipe.objective import RecipeMismatch
    with pytest.raises(RecipeMismatch, match="scrubnet tune") as e:
        scrubnet.forget(_net(), retain, forget, method="fisher", recipe=RECIPE)   # an untrained model
    assert "forgettable" in str(e.value) and "force=True" in str(e.value)


def test_choice_cheapest_within_else_the_unbroken_run_closing_most_else_the_closest():
    from scrubnet.tuning.profile import Trial, choose
    gold = {"retain_error": 0.0, "test_error": 0.2}
    m = lambda r, t: {"retain_error": r, "test_error": t}   # noqa: E731
    a = Trial("a", {"lr": 1}, m(0.01, 0.2), 0.1, 0.9, 5.0, True, within=True)
    b = Trial("b", {"lr": 2}, m(0.01, 0.2), 0.2, 0.6, 1.0, True, within=True)
    c = Trial("c", {"lr": 3}, m(0.00, 0.2), 0.05, 0.3, 0.5, True)
    d = Trial("d", {"lr": 4}, m(0.20, 0.2), 0.02, 0.95, 0.5, True)     # broken: retain error 20 points off
    assert choose([a, b, c, d], 10.0, gold)["method"] == "b"            # the cheapest within tolerance
    assert choose([c, d, Trial("e", {}, m(0, 0.2), 0.3, 0.4, 0.1, True)], 10.0, gold)["method"] == "e"
    assert choose([d], 10.0, gold)["method"] == "d" and not choose([d], 10.0, gold)["within"]
