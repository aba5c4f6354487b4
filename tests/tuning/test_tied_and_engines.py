"""Every model and engine: a model with tied weights (two names for one tensor, the HuggingFace default for
language models) is tuned and forgotten with ``method="auto"``; the tuning's runs as Ray tasks give the same
profile as a local run."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import scrubnet
from scrubnet.checkpoint import weights_sha256
from scrubnet.recipe import TrainingRecipe
from scrubnet.tuning.tune import tune

C = 3
RECIPE = TrainingRecipe(lr=0.1, momentum=0.9, batch_size=32, epochs=12)


class Tied(nn.Module):
    """An input embedding of the classes' prototypes tied to the output projection."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 8)
        self.embed = nn.Embedding(C, 8)
        self.head = nn.Linear(8, C, bias=False)
        self.head.weight = self.embed.weight          # tied: one tensor, two names in the state dict

    def forward(self, x):
        h = torch.relu(self.hidden(x))
        return self.head(h) + 0.1 * (h @ self.embed.weight.mean(0, keepdim=True).T)


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(C, (n,), generator=g)
    return torch.randn(n, 6, generator=g) + 1.5 * nn.functional.one_hot(y, 6).float(), y


def train(model: nn.Module, data) -> nn.Module:
    torch.manual_seed(3)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(4)
    for _ in range(RECIPE.epochs):
        for idx in torch.randperm(len(y), generator=g).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def tied():
    x, y = _data(240, 0)
    model = train(Tied(), (x, y))
    assert model.head.weight is model.embed.weight
    return model, (x[6:], y[6:]), (x[:6], y[:6]), _data(90, 1)


def test_a_tied_weights_model_is_tuned_and_forgotten_with_auto(tied):
    model, retain, forget, test = tied
    sha = weights_sha256(model)                       # safetensors alone refuses shared tensors
    untied = Tied()
    untied.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    untied.load_state_dict(model.state_dict())
    assert weights_sha256(untied) == sha              # the hash of the values, tied or not
    prof = tune(model, retain, forget, train=train, test=test, recipe=RECIPE, methods=("finetune", "neggrad"),
                budget=1, draws=2)
    assert prof.model_sha256 == sha and len(prof.trials) == 4
    scrubbed, res = scrubnet.forget(model, retain, forget, method="auto", profile=prof, recipe=RECIPE, test=test,
                                    on_failure="return", on_not_forgotten="warn")
    assert res.checks["auto"]["method"] == prof.method
    assert scrubbed.head.weight is scrubbed.embed.weight    # still tied after the scrub
    assert all(torch.isfinite(p).all() for p in scrubbed.parameters())


def test_ray_tasks_give_the_same_profile_as_a_local_run(tied, ray_cluster):
    pytest.importorskip("ray")
    from scrubnet.audit.engine import LocalEngine, RayEngine
    model, retain, forget, test = tied
    kw = dict(train=train, test=test, recipe=RECIPE, methods=("finetune", "neggrad"), budget=1, draws=2, seed=1)
    local = tune(model, retain, forget, engine=LocalEngine(), **kw)
    eng = RayEngine(num_cpus=1)
    try:
        remote = tune(model, retain, forget, engine=eng, **kw)
    finally:
        eng.close()
    assert remote.validation["engine"] == "ray" and local.validation["engine"] == "local"
    assert remote.chosen["method"] == local.chosen["method"] and remote.chosen["options"] == local.chosen["options"]
    assert [(t.method, t.options, t.draw) for t in remote.trials] == [(t.method, t.options, t.draw)
                                                                       for t in local.trials]
    for a, b in zip(local.trials, remote.trials):
        assert a.ok == b.ok and a.within == b.within and (a.work == b.work or math.isnan(a.work))
        for k, v in a.metrics.items():
            assert b.metrics[k] == pytest.approx(v, abs=1e-6), k
