"""TrainingRecipe: scrubnet's protocol as one recipe, the [recipe] TOML table with its checks, the centre."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from scrubnet._config import ConfigValueError
from scrubnet.methods import ForgetContext, protocol_context
from scrubnet.recipe import TrainingRecipe
from scrubnet.training import TrainConfig


def test_protocol_context_states_the_objective_once_in_its_recipe():
    start = torch.nn.Linear(3, 2)
    start.bias.requires_grad_(False)  # a frozen tensor is outside the objective: no centre for it
    cfg = TrainConfig(wd=0.07, lr=0.02, batch_size=64, max_epochs=9)
    ctx = protocol_context(start, cfg, num_classes=2, seed=4)
    r = ctx.recipe
    assert (r.wd, r.lr, r.batch_size, r.epochs, r.loss, r.freeze_bn) == (0.07, 0.02, 64, 10, "cross_entropy", True)
    assert r.pulls_to_start and set(r.wd_center) == {"weight"} and ctx.start is start and ctx.seed == 4
    assert torch.equal(r.wd_center["weight"], start.weight) and r.wd_center["weight"] is not start.weight
    with torch.no_grad():
        start.weight.add_(1.0)  # the centre is a copy: training the start later does not move it
    assert not torch.equal(r.wd_center["weight"], start.weight)
    assert ctx.config == cfg  # the recipe's settings over the schedule give back the protocol's configuration
    assert not hasattr(ctx, "w0")
    # the training settings a method sees are the recipe's, whatever the schedule says
    ctx2 = ForgetContext(recipe=TrainingRecipe(wd=0.5, lr=0.3), schedule=cfg)
    assert (ctx2.config.wd, ctx2.config.lr, ctx2.config.max_epochs) == (0.5, 0.3, 9)


def test_from_recipe_builds_the_context_from_the_model():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU())
    model.add_module("fc", torch.nn.Linear(5, 7))
    ctx = ForgetContext.from_recipe(model, TrainingRecipe(wd=1e-3, lr=0.1))
    assert ctx.num_classes == 7 and ctx.verify_recipe and ctx.config.lr == 0.1 and ctx.config.wd == 1e-3
    center = ctx.center(model)
    assert set(center) == {k for k, _ in model.named_parameters()}
    assert all(float(v.abs().sum()) == 0 for v in center.values())   # ordinary decay: centre 0
    with pytest.raises(ValueError, match="shape"):
        TrainingRecipe(wd=1.0, wd_center={"fc.weight": torch.zeros(3)}).center_for(model)
    with pytest.raises(ValueError, match="no trainable parameter"):
        TrainingRecipe(wd=1.0, wd_center={"nope": torch.zeros(3)}).center_for(model)


def test_toml_recipe_and_its_checks(tmp_path):
    save_file({"w": torch.arange(3.0)}, str(tmp_path / "w0.safetensors"))
    p = tmp_path / "r.toml"
    p.write_text('[recipe]\nloss = "mse"\nwd = 0.01\nwd_center = "w0.safetensors"\nlr = 0.2\nmomentum = 0\n'
                 'batch_size = 16\nepochs = 3\n')
    r = TrainingRecipe.from_toml(p)
    assert (r.loss, r.wd, r.lr, r.momentum, r.batch_size, r.epochs) == ("mse", 0.01, 0.2, 0.0, 16, 3)
    assert torch.equal(r.wd_center["w"], torch.arange(3.0)) and r.curvature_loss == "mse"
    for body, needle in (('wd = -1', "recipe.wd"), ('lr = "fast"', "recipe.lr"), ('batch_size = 2.5', "batch_size"),
                         ('loss = "hinge"', "recipe.loss"), ('wd_center = "missing.safetensors"', "wd_center"),
                         ('momentum = 1.0', "momentum"), ('colour = 1', "recipe.colour")):
        p.write_text(f"[recipe]\n{body}\n")
        with pytest.raises((ConfigValueError, ValueError), match=needle):
            TrainingRecipe.from_toml(p)
    p.write_text("[other]\nx = 1\n")
    with pytest.raises(ConfigValueError, match=r"no \[recipe\]"):
        TrainingRecipe.from_toml(p)
    assert TrainingRecipe.from_toml(_write(tmp_path, '[recipe]\nwd_center = "zero"\n')).wd_center is None


def _write(d, text):
    p = d / "z.toml"
    p.write_text(text)
    return p


def test_target_scale_is_part_of_the_recipe():
    r = TrainingRecipe(loss="mse", target_scale=15.0, wd=0.1)
    assert r.to_dict()["target_scale"] == 15.0 and "15·onehot" in r.describe()
    with pytest.raises(ValueError, match="MSE loss only"):
        TrainingRecipe(target_scale=2.0)
    with pytest.raises(ValueError, match="target_scale"):
        TrainingRecipe(loss="mse", target_scale=0.0)
