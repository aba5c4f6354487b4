"""The artifact cache of one seed: keys from weights, data and options; different options never share."""
import copy

import pytest
import torch

from scrubnet.curvature.params import get_flat
from scrubnet.methods import get_method
from scrubnet.methods.artifacts import (ArtifactCache, ArtifactKey, artifact_key, fisher_key, ntk_direction_key,
                                        retrain_key, weights_fingerprint)
from scrubnet.models import build_model
from scrubnet.training import TrainConfig
from tests.conftest import protocol_ctx

C = 3


def _setup():
    model = build_model("mlp", (6,), C, seed=3, hidden=8).double().eval()
    start = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (12,), generator=g)
    ctx = protocol_ctx(w0={k: v.detach().clone() for k, v in start.named_parameters()}, config=TrainConfig(wd=0.05),
                        num_classes=C, seed=0)
    return model, start, (x[:9], y[:9]), (x[9:], y[9:]), ctx


def test_key_parts_each_separate_entries():
    model, start, retain, forget, _ = _setup()
    base = artifact_key("a", weights=[model], data=[*retain], options={"t": 1e-5})
    assert base == artifact_key("a", weights=[copy.deepcopy(model)], data=[retain[0].clone(), retain[1].clone()],
                                options={"t": 1e-5})
    others = [artifact_key("b", weights=[model], data=[*retain], options={"t": 1e-5}),
              artifact_key("a", weights=[start], data=[*retain], options={"t": 1e-5}),
              artifact_key("a", weights=[model], data=[*forget], options={"t": 1e-5}),
              artifact_key("a", weights=[model], data=[*retain], options={"t": 1.0000001e-5}),
              artifact_key("a", weights=[model], data=[*retain], options={"t": 1e-5, "u": None})]
    assert len({base, *others}) == 6
    # a BatchNorm statistic is part of the weights
    bn = build_model("cnn1d", (12,), C, seed=0, channels=2)
    before = weights_fingerprint(bn)
    next(m for m in bn.modules() if isinstance(m, torch.nn.BatchNorm1d)).running_mean.add_(1.0)
    assert weights_fingerprint(bn) != before


def test_cache_is_typed_and_counts():
    cache = ArtifactCache()
    key = artifact_key("a", options={"x": 1})
    calls = []
    assert cache.get_or_compute(key, lambda: calls.append(1) or "v") == "v"
    assert cache.get_or_compute(key, lambda: calls.append(1) or "w") == "v"
    assert calls == [1] and (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    with pytest.raises(TypeError):
        cache.get_or_compute(("a",), lambda: 1)
    with pytest.raises(TypeError):
        artifact_key("a", options={"f": object()})


def test_package_keys_include_what_changes_the_artifact():
    model, start, retain, forget, ctx = _setup()
    assert fisher_key(model, *retain, "true") != fisher_key(model, *retain, "empirical")
    # the true Fisher ignores labels, the empirical one does not
    flipped = (retain[0], (retain[1] + 1) % C)
    assert fisher_key(model, *retain, "true") == fisher_key(model, *flipped, "true")
    assert fisher_key(model, *retain, "empirical") != fisher_key(model, *flipped, "empirical")
    kw = dict(wd=0.05, num_classes=C, options={"pull": "w0"})
    k = ntk_direction_key(model, ctx.center(model), retain, forget, **kw)
    assert k != ntk_direction_key(model, ctx.center(model), retain, forget, **{**kw, "wd": 0.1})
    assert k != ntk_direction_key(model, ctx.center(model), retain, forget, **{**kw, "options": {"pull": "point"}})
    assert k != ntk_direction_key(model, dict(model.named_parameters()), retain, forget, **kw)
    x = torch.cat([retain[0], forget[0]])
    y = torch.cat([retain[1], forget[1]])
    r = dict(train=TrainConfig().to_dict(), seed=0)
    assert len({retrain_key(start, x, y, torch.tensor([9]), **r, mode="replace"),
                retrain_key(start, x, y, torch.tensor([9]), **r, mode="remove"),
                retrain_key(start, x, y, torch.tensor([8]), **r, mode="replace"),
                retrain_key(start, x, y, torch.tensor([9]), train=TrainConfig(wd=0.1).to_dict(), seed=0,
                            mode="replace"),
                retrain_key(start, x, y, torch.tensor([9]), **{**r, "seed": 1}, mode="replace")}) == 5


@pytest.mark.parametrize("options", [{"pull": "point"}, {"linearize_at": "w0"},
                                     {"ridge": "fixed", "ridge_value": 0.3}, {"solver": "cg", "cg_tol": 1e-3}])
def test_ntk_methods_with_different_options_never_share_a_direction(options):
    model, _, retain, forget, ctx = _setup()
    default = get_method("ntk")(model, retain, forget, ctx)
    other = get_method("ntk", **options)(model, retain, forget, ctx)
    assert "cached" not in other.info and len(ctx.cache) == 2
    assert not torch.allclose(get_flat(default.model), get_flat(other.model), rtol=0, atol=1e-9)
    again = get_method("ntk", **options)(model, retain, forget, ctx)
    assert again.info["cached"] == 1.0 and torch.equal(get_flat(again.model), get_flat(other.model))
    assert all(isinstance(k, ArtifactKey) and k.kind == "ntk_direction" for k in ctx.cache.keys())


def test_fisher_and_ntk_fisher_share_the_fisher_of_one_model():
    model, _, retain, forget, ctx = _setup()
    fisher = get_method("fisher")
    fisher(model, retain, forget, ctx)
    assert ctx.cache.misses == 1
    fisher.noise_at(model, retain, forget, ctx)  # the same model's Fisher again: a hit
    assert ctx.cache.hits == 1 and ctx.cache.misses == 1
    get_method("fisher", kind="empirical")(model, retain, forget, ctx)  # another kind: a new entry
    assert ctx.cache.misses == 2
