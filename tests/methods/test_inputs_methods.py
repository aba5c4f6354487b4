"""The methods' own entry points on users' inputs: ntk-fisher's information bound against a reference,
ml_from_network on a two-layer head and on a tiny BERT, and LQF training that diverges."""
import math

import pytest
import torch
from torch import nn

import scrubnet
from scrubnet.data.stream import as_stream
from scrubnet.methods import ForgetContext, get_method
from scrubnet.methods.fisher import fisher_noise
from scrubnet.training.lqf import LQFConfig, LQFDiverged, train_lqf
from scrubnet.mlforget import ml_from_network
from scrubnet.models.call import ModelInputs
from scrubnet.recipe import TrainingRecipe
from scrubnet.training import predict_logits


def blobs(n=120, d=6, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, c, generator=g)).argmax(1)
    return x, y


def fit(net, x, y, steps=300, wd=0.0):
    opt = torch.optim.Adam(net.parameters(), 1e-2, weight_decay=wd)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval()


def error(model, x, y):
    return float((predict_logits(model, x).argmax(1) != y).float().mean())


def test_ntk_fisher_with_a_reference_gives_the_bound():
    torch.manual_seed(0)
    x, y = blobs(60)
    net = fit(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), x, y)
    ref = fit(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), x[10:], y[10:])
    recipe = TrainingRecipe(wd=1e-3)
    _, res = scrubnet.forget(net, (x[10:], y[10:]), (x[:10], y[:10]), method="ntk-fisher", recipe=recipe,
                             reference=ref, force=True, on_failure="return", alpha=1e-6)
    assert math.isfinite(res.bounds["info_weights_nats"]) and res.bounds["info_weights_nats"] > 0
    # the streamed noise_at is the in-memory Fisher noise at the reference
    method = get_method("ntk-fisher", alpha=1e-6)
    ctx = ForgetContext.from_recipe(ref, recipe, num_classes=3)
    got = method.noise_at(ref, as_stream((x[10:], y[10:])), as_stream((x[:10], y[:10])), ctx)
    _, mean, var = fisher_noise(ref, (x[10:], y[10:]), alpha=1e-6, num_classes=3, seed=0)
    for k in mean:
        torch.testing.assert_close(got.mean[k], mean[k])
        torch.testing.assert_close(got.var[k], var[k])


def test_ml_from_network_centres_a_two_layer_head_where_it_can_fit():
    torch.manual_seed(0)
    x, y = blobs(300, d=10)
    net = nn.Sequential()
    net.add_module("body", nn.Sequential(nn.Linear(10, 32), nn.ReLU()))
    net.add_module("head", nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)))
    fit(net, x, y)
    state = ml_from_network(net, x, y)
    assert state.num_classes == 3
    assert error(state.model, x, y) <= error(net, x, y) + 0.03
    with pytest.raises(ValueError, match="Jacobian of every layer but the last vanishes"):
        ml_from_network(net, x, y, center="zero")


def test_ml_from_network_on_a_tiny_bert_reads_the_mask():
    pytest.importorskip("transformers")
    from tests.hf_models import tiny_bert, token_batch

    b = token_batch(40)
    x = ModelInputs(b["input_ids"], {"attention_mask": b["attention_mask"]})
    state = ml_from_network(tiny_bert(), x, b["labels"])
    assert state.num_classes == 3
    unmasked = ml_from_network(tiny_bert(), b["input_ids"], b["labels"], 3)
    with torch.no_grad():
        f_mask = predict_logits(state.model, x)
        f_none = predict_logits(unmasked.model, b["input_ids"])
    assert torch.isfinite(f_mask).all()
    assert float((f_mask - f_none).abs().max()) > 1e-3   # trained on what the model sees with its mask
    assert error(state.model, x, b["labels"]) < 0.5


def test_train_lqf_reports_divergence():
    torch.manual_seed(2)
    x = torch.randn(40, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    cfg = LQFConfig(wd=0.05, leaky_slope=None, lr=1e3, momentum=0.9, epochs=200, batch_size=40, optimizer="sgd")
    with pytest.raises(LQFDiverged, match="diverged at epoch"):
        train_lqf(nn.Linear(5, 3).double(), x, y, 3, cfg)
