"""The ecosystem's habits: a dumped configuration that loads back unchanged, one help line per option, and the
classifier found under the names torchvision and timm use."""
import copy

import pytest
import torch
from torch import nn
from typer.main import get_command
from typer.testing import CliRunner

from scrubnet.cli import app
from scrubnet.experiments.config import ExperimentConfig, load_config
from scrubnet.methods import get_method
from scrubnet.methods.base import available_methods
from scrubnet.methods.fisher import head_param_names
from scrubnet.models import find_classifier
from tests.conftest import protocol_ctx

runner = CliRunner()


def test_config_dump_loads_back_unchanged(tmp_path):
    r = runner.invoke(app, ["config", "--dump"])
    assert r.exit_code == 0, r.output
    text = r.output
    p = tmp_path / "my.toml"
    p.write_text(text)
    assert load_config(p) == ExperimentConfig()
    for key in ("lr", "max_epochs", "seeds", "relearn_max_epochs", "n_train_per_class", "forget_ids", "data_dir"):
        line = next(line for line in text.splitlines() if line.lstrip("# ").startswith(key + " ="))
        assert "  # " in line  # every key carries its meaning and unit
    # an edited file round-trips through --config too
    p.write_text(text.replace("seeds = [0, 1, 2]", "seeds = [4]").replace("[model_options]", "[model_options]\nhidden = 32"))
    r = runner.invoke(app, ["config", "--dump", "--config", str(p)])
    assert r.exit_code == 0, r.output
    q = tmp_path / "again.toml"
    q.write_text(r.output)
    assert load_config(q) == load_config(p) and load_config(q).seeds == [4]
    assert runner.invoke(app, ["config", "--config", str(p)]).exit_code == 0


def _commands(cmd, path=()):
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, path + (name,))
    else:
        yield " ".join(path), cmd


def test_every_option_of_every_command_has_one_help_line():
    cmds = dict(_commands(get_command(app)))
    assert {"run", "train", "forget", "evaluate", "report", "sweep", "config", "mlforget forget",
            "mlforget show"} <= set(cmds)
    for name, cmd in cmds.items():
        assert cmd.help, name
        for p in cmd.params:
            assert p.help and "\n" not in p.help, (name, p.name)
        assert "threads" in {p.name for p in cmd.params}, name
    for m in available_methods():
        if not m.startswith("mlforget"):
            assert m in cmds["forget"].params[[p.name for p in cmds["forget"].params].index("method")].help


class TorchvisionLike(nn.Module):
    def __init__(self, attr, sequential=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        last = nn.Linear(8, 3)
        setattr(self, attr, nn.Sequential(nn.Dropout(0.0), last) if sequential else last)
        self.attr = attr

    def forward(self, x):
        return getattr(self, self.attr)(self.body(x))


@pytest.mark.parametrize("attr,sequential,expected", [("head", False, "head"), ("fc", False, "fc"),
                                                      ("classifier", True, "classifier.1"),
                                                      ("last_linear", False, None)])
def test_classifier_is_found_by_its_usual_names(attr, sequential, expected):
    model = TorchvisionLike(attr, sequential)
    if expected is None:
        with pytest.raises(ValueError, match="classifier=NAME"):
            find_classifier(model)
        assert find_classifier(model, "last_linear")[0] == "last_linear"
        expected = "last_linear"
        opts = {"classifier": "last_linear"}
    else:
        assert find_classifier(model)[0] == expected
        opts = {}
    assert head_param_names(model, 3, opts.get("classifier")) == {f"{expected}.weight", f"{expected}.bias"}
    # Hiding re-initialises exactly the forgotten row of that layer
    ctx = protocol_ctx(w0={}, num_classes=3, forget_class=1)
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 1])
    out = get_method("hiding", **opts)(model, (x, y), (x, y), ctx).model
    before, after = model.get_submodule(expected).weight, out.get_submodule(expected).weight
    assert not torch.equal(before[1], after[1])
    assert torch.equal(before[[0, 2]], after[[0, 2]])
    assert torch.equal(copy.deepcopy(model).body[0].weight, out.body[0].weight)
