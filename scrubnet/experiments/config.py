"""Experiment configuration: dataclasses + TOML loading, with clear errors for unknown keys and for values of
the wrong type or range (:mod:`scrubnet._config`)."""
from __future__ import annotations

import json
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scrubnet._config import ConfigValueError, check_value, tiny_mode, under_defaults
from scrubnet.data.registry import DataConfig
from scrubnet.readouts.relearn import RELEARN_MAX_EPOCHS
from scrubnet.training import DEFAULT_RETRAIN_MODE, RETRAIN_MODES, TrainConfig


@dataclass
class ExperimentConfig:
    """One experiment: data split, model, training protocol, methods × seeds.

    The default ``train`` is :class:`~scrubnet.training.TrainConfig`'s, whose wd = 0.03 replaces the papers'
    0.1 (docs/decisions/conventions.md, "Training protocol": with 0.1 the MLP on the 500-sample MNIST-1D task never
    reaches zero training error, so the protocol's stopping rule never fires).

    ``methods=None`` means every registered method that applies (class-only methods such as Hiding
    only when a whole class is forgotten). ``retrain_mode`` is how the gold standard is trained
    (``replace``: the authors' code, |D| kept by copies of retained samples; ``remove``: D_r only).
    """

    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: str = "mlp"
    model_options: dict = field(default_factory=dict)
    methods: list[str] | None = None
    method_options: dict = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    retrain_mode: str = DEFAULT_RETRAIN_MODE
    relearn_max_epochs: int = RELEARN_MAX_EPOCHS

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ExperimentConfig":
        """The configuration ``d`` describes (missing keys take their defaults; with ``SCRUBNET_TINY=1`` the
        defaults of :data:`TINY_EXPERIMENT`)."""
        d = under_defaults(TINY_EXPERIMENT, d) if tiny_mode() else dict(d)
        known = {"data", "train", "model", "model_options", "methods", "method_options", "seeds", "retrain_mode",
                 "relearn_max_epochs"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown configuration key(s): {', '.join(unknown)}")
        for k, v in d.items():
            if k not in ("data", "train"):
                d[k] = check_value(k, v, _HINTS[k], {"seeds": ">= 0", "relearn_max_epochs": ">= 1"}.get(k))
        for k in ("data", "train"):
            if not isinstance(d.get(k, {}), dict):
                raise ConfigValueError(f"configuration key {k}: expected a table (dict), got {d[k]!r}")
        data = DataConfig.from_dict(d.pop("data", {}) or {}, prefix="data.")
        train = TrainConfig.from_dict({**cls().train.to_dict(), **(d.pop("train", {}) or {})}, prefix="train.")
        cfg = cls(data=data, train=train, **d)
        if cfg.retrain_mode not in RETRAIN_MODES:
            raise ValueError(f"configuration key retrain_mode: expected one of {', '.join(RETRAIN_MODES)}, got "
                             f"{cfg.retrain_mode!r}")
        if not cfg.seeds:
            raise ValueError("configuration key seeds: at least one seed is needed")
        if len(set(cfg.seeds)) != len(cfg.seeds):
            raise ValueError(f"configuration key seeds: duplicated seeds in {cfg.seeds} (each would be run twice)")
        return cfg


_HINTS = typing.get_type_hints(ExperimentConfig)

#: the defaults under ``SCRUBNET_TINY=1`` (:func:`scrubnet._config.tiny_mode`): one seed, 100 samples in D, 15
#: epochs; every command then runs in seconds (the README test uses it). The architecture keeps its defaults
#: (an option such as ``hidden`` would not fit every ``--model``).
TINY_EXPERIMENT = {"seeds": [0], "relearn_max_epochs": 5,
                   "data": {"n_train_per_class": 20, "n_test_per_class": 20, "core_per_class": 40, "forget_count": 5,
                            "num_samples": 1500},
                   "train": {"max_epochs": 15, "pretrain_epochs": 2, "batch_size": 32}}


def read_toml(path: str | Path) -> dict:
    """The TOML file at ``path`` as a dict; clear errors for a missing or malformed file."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"configuration file not found: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"configuration file {p} is not valid TOML: {e}") from None


def load_config(path: str | Path) -> ExperimentConfig:
    """Read an :class:`ExperimentConfig` from a TOML file (top-level keys as in ``to_dict``)."""
    return ExperimentConfig.from_dict(read_toml(path))


#: one line per configuration key: what it is and its unit (``scrubnet config --dump`` writes them as comments)
KEY_DOCS = {
    "model": "architecture: mlp | cnn1d | cnn2d | allcnn | resnet18",
    "methods": "methods to run (unset: every method that applies)",
    "seeds": "seeds; one protocol run per seed (integers, no duplicates)",
    "retrain_mode": "gold standard: replace (forgotten samples replaced by copies of retained ones) | remove",
    "relearn_max_epochs": "cap of the re-learn-time readout, in epochs (≥ 1)",
    "model_options": "architecture options, e.g. hidden = 256 (units: neurons, channels)",
    "method_options": "per-method options, e.g. [method_options.fisher] alpha = 3e-6",
    "data.dataset": "mnist1d | digits | cifar10 | cifar100 | imagefolder",
    "data.data_dir": "directory of a file-based dataset (unset for the embedded ones)",
    "data.core_classes": "classes used for pre-training (dataset labels)",
    "data.task_classes": "classes of D and D_test (dataset labels)",
    "data.n_train_per_class": "samples per task class in D (count)",
    "data.n_test_per_class": "samples per task class in D_test (count)",
    "data.core_per_class": "pre-training samples per core class (count; unset: all)",
    "data.forget_class": "forgotten class, as a task index (0 = first task class)",
    "data.forget_count": "samples of the forget class in D_f (count; unset: the whole class)",
    "data.forget_ids": "explicit D_f as positions in D (replaces forget_class/forget_count)",
    "data.data_seed": "seed of which samples enter D, D_test, the core and D_f",
    "data.num_samples": "MNIST-1D generator pool size (count)",
    "train.lr": "fine-tuning learning rate (per SGD step)",
    "train.momentum": "fine-tuning SGD momentum, in [0, 1)",
    "train.wd": "coefficient of (wd/2)·‖w − w_0‖² during fine-tuning",
    "train.batch_size": "fine-tuning mini-batch (samples)",
    "train.extra_epochs": "epochs after the first zero-training-error epoch",
    "train.min_epochs": "fine-tuning epochs at least",
    "train.max_epochs": "fine-tuning epochs at most (the cap; reported when hit before zero training error)",
    "train.freeze_bn": "BatchNorm statistics frozen during fine-tuning",
    "train.pretrain_epochs": "pre-training epochs on the core classes",
    "train.pretrain_lr": "pre-training learning rate (per SGD step)",
    "train.pretrain_momentum": "pre-training SGD momentum, in [0, 1)",
    "train.pretrain_wd": "pre-training weight decay (toward 0)",
    "train.pretrain_batch_size": "pre-training mini-batch (samples)",
    "train.wd_from": "first fine-tuning epoch with the pull (0-based; schedules: on in [from, until))",
    "train.wd_until": "fine-tuning epoch where the pull stops (unset: never)",
    "train.pretrain_wd_from": "first pre-training epoch with weight decay",
    "train.pretrain_wd_until": "pre-training epoch where weight decay stops (unset: never)",
    "train.augment": "fine-tuning augmentation: none | shift_noise (random shift + Gaussian noise) | crop_flip "
                     "(CIFAR's 4-pixel pad-and-crop + horizontal flip)",
    "train.decay_toward": "target of the fine-tuning decay: init (the pull toward w_0) | zero (SGD weight decay)",
    "train.lr_milestones": "epochs after which the rate is multiplied by lr_gamma (a step schedule; empty: constant)",
    "train.lr_gamma": "the step schedule's factor",
    "train.augment_from": "first fine-tuning epoch with augmentation",
    "train.augment_until": "fine-tuning epoch where augmentation stops (unset: never)",
    "train.pretrain_augment": "pre-training augmentation: none | shift_noise | crop_flip",
    "train.pretrain_augment_from": "first pre-training epoch with augmentation",
    "train.pretrain_augment_until": "pre-training epoch where augmentation stops (unset: never)",
}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as a TOML value")


def _toml_table(d: dict, prefix: str, lines: list[str]) -> None:
    """``key = value  # doc`` lines of the plain values of ``d``; None is written commented out."""
    for k, v in d.items():
        if isinstance(v, dict):
            continue
        doc = KEY_DOCS.get(prefix + k, "")
        comment = f"  # {doc}" if doc else ""
        if v is None:
            lines.append(f"# {k} ={comment or '  # unset'}")
        else:
            lines.append(f"{k} = {_toml_value(v)}{comment}")


def _toml_subtables(d: dict, name: str, lines: list[str]) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            lines += ["", f"[{name}.{k}]"]
            _toml_table(v, "", lines)
            _toml_subtables(v, f"{name}.{k}", lines)


def dump_toml(cfg: ExperimentConfig | None = None) -> str:
    """Every key of ``cfg`` (default: the defaults) as TOML, each with its meaning and unit as a comment;
    :func:`load_config` reads it back to an equal configuration."""
    d = (cfg or ExperimentConfig()).to_dict()
    lines = ["# scrubnet experiment configuration: every key with its value (the defaults unless edited).",
             "# Use it with `scrubnet run --config FILE`. Keys shown as `# key =` are unset.", ""]
    top = {k: v for k, v in d.items() if k not in ("data", "train")}
    _toml_table(top, "", lines)
    for name in ("data", "train"):
        lines += ["", f"[{name}]"]
        _toml_table(d[name], f"{name}.", lines)
    for name in ("model_options", "method_options"):
        lines += ["", f"# {KEY_DOCS[name]}", f"[{name}]"]
        _toml_table(d[name], "", lines)
        _toml_subtables(d[name], name, lines)
    return "\n".join(lines) + "\n"
