"""The user's retraining as the yardstick: :func:`scrubnet.retrain_like_user` and ``method="retrain"``.

Each fast path is checked against an obviously-correct twin: the user's own function called by hand, and a
hand-written AdamW + cosine loop for the recipe reproduced.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import scrubnet
from scrubnet.methods import ForgetContext, get_method
from scrubnet.recipe import TrainingRecipe
from scrubnet.recipe.retrain import initial_model, make_optimizer, measure_retraining, retrain_like_user


def _data(n=96, d=10, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, c, (n,), generator=g)
    return x, y


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _users_train(model, data):
    """A user's training function: its own optimiser, its own (global-generator) shuffling and dropout."""
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(3):
        perm = torch.randperm(len(y))
        for i in range(0, len(y), 16):
            idx = perm[i:i + 16]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def test_retrain_with_the_users_function_is_that_function_on_D_r_bit_identical():
    m = _net()
    x, y = _data()
    retain = (x[:80], y[:80])
    got = retrain_like_user(m, retain, train=_users_train, seed=3)
    torch.manual_seed(3)                                   # the twin: the user's function called by hand
    want = _users_train(initial_model(m, 3), retain)
    assert torch.equal(_flat(got), _flat(want))
    assert not torch.equal(_flat(got), _flat(retrain_like_user(m, retain, train=_users_train, seed=4)))
    # through scrubnet.forget(method="retrain", train=...): the same model
    out, res = scrubnet.forget(m, retain, (x[80:], y[80:]), method="retrain", train=_users_train, seed=3,
                               on_failure="return")
    assert torch.equal(_flat(out), _flat(want)) and res.report["retrain_user_function"] == 1.0
    # the global generator is left as it was
    torch.manual_seed(11)
    a = torch.rand(1)
    torch.manual_seed(11)
    retrain_like_user(m, retain, train=_users_train, seed=3)
    assert torch.equal(torch.rand(1), a)


class _DictSet(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


class _FakeTrainer:
    """Shaped like a HuggingFace Trainer: ``train()`` trains ``self.model`` on ``self.train_dataset``."""

    def __init__(self):
        self.model, self.args, self.train_dataset, self.optimizer, self.lr_scheduler = None, object(), None, None, None

    def train(self):
        loader = DataLoader(self.train_dataset, batch_size=16, shuffle=True)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        for batch in loader:
            loss = nn.functional.cross_entropy(self.model(batch["input_ids"]), batch["labels"])
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_a_trainer_is_handed_the_users_dataset_of_dict_batches():
    m = _net()
    x, y = _data()
    loader = DataLoader(_DictSet(x[:80], y[:80]), batch_size=16)
    got = retrain_like_user(m, loader, train=_FakeTrainer(), seed=1)
    t = _FakeTrainer()
    torch.manual_seed(1)
    t.model, t.train_dataset = initial_model(m, 1), _DictSet(x[:80], y[:80])
    t.train()
    assert torch.equal(_flat(got), _flat(t.model))


class _FrozenBackbone(nn.Module):
    """A frozen pretrained backbone (BatchNorm statistics included) with a trainable head; a bare parameter."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.scale = nn.Parameter(torch.ones(16))          # bare, trainable
        self.head = nn.Linear(16, 3)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x) * self.scale)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_frozen_parameters_never_move_and_bare_parameters_are_retrained(optimizer):
    torch.manual_seed(0)
    m = _FrozenBackbone()
    with torch.no_grad():                                  # "pretrained": weights and statistics not the init's
        m.backbone[0].weight.mul_(3.0)
        m.backbone[1].running_mean.fill_(0.5)
        m.scale.fill_(2.0)
    x, y = _data()
    recipe = TrainingRecipe(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 1e-2, epochs=2, batch_size=16,
                            wd=5e-4 if optimizer == "sgd" else 0.0,
                            adamw_weight_decay=0.05 if optimizer == "adamw" else 0.0, schedule="cosine")
    start = initial_model(m, 0)
    out = retrain_like_user(m, (x, y), recipe=recipe, seed=0)
    out_fn = retrain_like_user(m, (x, y), train=_users_train, seed=0)
    frozen = dict(m.backbone.named_parameters())
    for model in (start, out, out_fn):                               # frozen weights, bit for bit
        assert all(torch.equal(p, frozen[k]) for k, p in model.backbone.named_parameters())
    sd, sd0 = start.backbone.state_dict(), m.backbone.state_dict()   # the start keeps the statistics too
    assert all(torch.equal(sd[k], sd0[k]) for k in sd0)
    # training in train mode updates BatchNorm statistics as the user's training did; freeze_bn keeps them
    kept = retrain_like_user(m, (x, y), recipe=replace(recipe, freeze_bn=True), seed=0).backbone.state_dict()
    assert all(torch.equal(kept[k], sd0[k]) for k in sd0)
    assert not torch.equal(start.scale, m.scale) and float(start.scale.detach().abs().max()) <= 0.04 + 1e-7
    assert not torch.equal(out.scale, start.scale)                   # the bare parameter trained
    assert not torch.equal(start.head.weight, m.head.weight)         # the head re-drawn


def _adamw_cosine_twin(model, x, y, recipe, seed, decayed):
    """The recipe reproduced by hand: torch's AdamW and LambdaLR, the same seeded batch order."""
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for k, p in named if k in decayed],
                              "weight_decay": recipe.adamw_weight_decay},
                             {"params": [p for k, p in named if k not in decayed], "weight_decay": 0.0}],
                            lr=recipe.lr, betas=recipe.betas)
    steps = recipe.epochs * math.ceil(len(y) / recipe.batch_size)
    shape = {"cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t / steps)), "linear": lambda t: 1 - t / steps}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, shape[recipe.schedule])
    g = torch.Generator().manual_seed(10_007 * seed + 9)
    for _ in range(recipe.epochs):
        model.train()
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), recipe.batch_size):
            idx = perm[i:i + recipe.batch_size]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx], label_smoothing=recipe.label_smoothing)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_an_adamw_recipe_is_reproduced_and_never_hands_its_rate_to_sgd(monkeypatch, schedule):
    m = _net()
    x, y = _data()
    opt = torch.optim.AdamW([{"params": [p for n, p in m.named_parameters() if n.endswith("weight")],
                              "weight_decay": 0.05},
                             {"params": [p for n, p in m.named_parameters() if n.endswith("bias")],
                              "weight_decay": 0.0}], lr=2e-3)
    for _ in range(3):                                     # a few steps so the state holds second moments
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    recipe = TrainingRecipe.from_adamw(m, opt, label_smoothing=0.1, schedule=schedule, epochs=3, batch_size=16)
    assert recipe.optimizer == "adamw" and recipe.lr == 2e-3 and recipe.adamw_weight_decay == 0.05
    decayed = {"0.weight", "3.weight"}
    got = retrain_like_user(m, (x, y), recipe=recipe, seed=2)
    torch.manual_seed(2)                                   # dropout's draws, as the retraining seeds them
    want = _adamw_cosine_twin(initial_model(m, 2), x, y, recipe, 2, decayed)
    assert torch.allclose(_flat(got), _flat(want), atol=1e-6)
    # no SGD anywhere: not in the retraining, not in the fine-tuning baselines under this recipe
    assert isinstance(make_optimizer(m, recipe), torch.optim.AdamW)

    def no_sgd(*a, **k):
        raise AssertionError("an AdamW recipe's rate was handed to SGD")
    monkeypatch.setattr(torch.optim, "SGD", no_sgd)
    retrain_like_user(m, (x, y), recipe=recipe, seed=2)
    for method in ("retrain", "finetune", "neggrad", "randomlabels")[:4 if schedule == "cosine" else 1]:
        for retain in ((x[:80], y[:80]), _DictSet(x[:80], y[:80])):
            scrubnet.forget(m, retain, (x[80:], y[80:]), method=method, recipe=recipe, on_failure="return",
                            **({} if method == "retrain" else {"epochs": 1}))


def test_fine_tuning_baselines_train_their_own_epochs_not_the_recipes():
    m = _net()
    x, y = _data()
    recipe = TrainingRecipe(epochs=60, batch_size=16, lr=0.01)   # how the model was trained: 60 epochs
    steps = []
    orig = torch.optim.SGD.step

    def counting(self, *a, **k):
        steps.append(1)
        return orig(self, *a, **k)
    torch.optim.SGD.step = counting
    try:
        ctx = ForgetContext.from_recipe(m, recipe, num_classes=3)
        get_method("finetune")(m, (x[:80], y[:80]), (x[80:], y[80:]), ctx)
    finally:
        torch.optim.SGD.step = orig
    assert len(steps) == 10 * 5                            # 10 epochs of 80/16 batches, not 60


def test_the_measured_retraining_prices_the_users_function_and_the_recipe():
    m = _net()
    x, y = _data(n=400)
    calls = []

    def train(model, data):
        calls.append(len(data[1]))
        return _users_train(model, data)
    est = measure_retraining(m, (x, y), train=train, probe_samples=50)
    # each probe size run once, or again while its runs took under USER_PROBE_MIN_SECONDS
    assert calls[0] == 50 and set(calls) == {50, 100} and calls == sorted(calls)
    assert est.seconds > 0 and est.details["probe_seconds"] > 0
    r = TrainingRecipe(epochs=7, batch_size=32)
    est = measure_retraining(m, (x, y), recipe=r)
    assert est.details["optimiser_steps"] == 7 * 13 and est.seconds == pytest.approx(
        est.details["step_seconds"] * 7 * 13)


def test_retrain_refuses_a_function_that_returns_no_model():
    m = _net()
    with pytest.raises(TypeError, match="not the trained nn.Module"):
        retrain_like_user(m, _data(), train=lambda model, data: 3, seed=0)
    with pytest.raises(ValueError, match="train=.*recipe="):
        retrain_like_user(m, _data())


def test_a_budgeted_mode_is_sized_under_the_measured_retraining(monkeypatch):
    """The reference of a user's model is the measured retraining (once per process for the same call); a
    method whose estimate is above it runs its budgeted mode, sized under it."""
    import scrubnet.cost_guard as cg
    from scrubnet.training.cost import CostEstimate
    m = _net()
    x, y = _data(300)
    recipe = TrainingRecipe(epochs=3, batch_size=32)
    full = cg.estimate(m, 280, 20, method="newton", x_probe=x[:1], recipe=recipe)
    seconds = full.ceiling / 10                            # the full Newton: ten of these retrainings
    calls = []

    def measured(*a, **k):
        calls.append(1)
        return CostEstimate("retrain (measured)", float("nan"), seconds, 0, 3.0, {"probe_seconds": 0.0})
    monkeypatch.setattr(cg, "measure_retraining", measured)
    monkeypatch.setattr(cg, "_MEASURED", {})
    _, res = scrubnet.forget(m, (x[:280], y[:280]), (x[280:], y[280:]), method="newton", recipe=recipe, force=True,
                             on_failure="return")
    assert calls == [1] and res.cost["retrain_seconds_estimate"] == seconds
    assert res.cost["budgeted"].startswith("cg_budget=")
    assert res.cost.get("estimate_seconds_upper", res.cost["estimate_seconds"]) <= seconds


def test_the_training_fields_read_from_toml_and_bad_ones_are_refused(tmp_path):
    from scrubnet._config import ConfigValueError
    p = tmp_path / "r.toml"
    p.write_text('[recipe]\noptimizer = "adamw"\nschedule = "cosine"\nadamw_weight_decay = 0.05\n'
                 'betas = [0.9, 0.98]\nlr = 1e-3\nepochs = 60\n')
    r = TrainingRecipe.from_toml(p)
    assert (r.optimizer, r.schedule, r.adamw_weight_decay, r.betas, r.epochs) == ("adamw", "cosine", 0.05,
                                                                                  (0.9, 0.98), 60)
    assert TrainingRecipe.from_dict(r.to_dict() | {"wd_center": "zero"}) == r
    for bad in ('optimizer = "adam"', 'schedule = "step"', 'betas = [0.9]'):
        p.write_text(f"[recipe]\n{bad}\n")
        with pytest.raises(ConfigValueError, match=bad.split()[0]):
            TrainingRecipe.from_toml(p)
    with pytest.raises(ValueError, match="adamw_weight_decay"):
        TrainingRecipe(adamw_weight_decay=0.1)          # an SGD recipe has no decoupled decay


def test_a_huggingface_trainer_is_the_users_training(tmp_path):
    """A real ``transformers.Trainer`` (tiny BERT from a config, nothing downloaded): retrain runs it on D_r from
    the re-drawn start, the same as that Trainer run by hand on that start; the user's Trainer keeps its model."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_models import tiny_bert, token_batch
    from transformers import Trainer, TrainingArguments
    b = token_batch(32)
    m = tiny_bert()
    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=1, per_device_train_batch_size=8,
                             learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=m, args=args, train_dataset=_DictSet(b["input_ids"], b["labels"]))
    got = retrain_like_user(m, _DictSet(b["input_ids"], b["labels"]), train=trainer, seed=0)
    torch.manual_seed(0)
    twin = Trainer(model=initial_model(m, 0), args=args, train_dataset=_DictSet(b["input_ids"], b["labels"]))
    torch.manual_seed(0)
    twin.train()
    assert trainer.model is m and not torch.equal(_flat(got), _flat(m))
    assert torch.equal(_flat(got), _flat(twin.model))
