"""How the user's model was trained, stated once: :class:`TrainingRecipe`.

Every scrubbing method needs the objective the model minimised. The recipe states it as

    L(w) = (1/N) Σ_i ℓ(f_w(x_i), y_i) + (wd/2)·‖w − c‖²

with ℓ the cross-entropy (``loss="cross_entropy"``; against (1 − ε)·onehot(y) + ε/c with label smoothing
ε = ``label_smoothing``, 0 by default) or ½‖f − s·onehot(y)‖² (``loss="mse"``, LQF-style models;
s = ``target_scale``, 1 by default, LQF's 15), :attr:`TrainingRecipe.loss_spec` and
:meth:`TrainingRecipe.loss_fn` the one definition every method uses,
``wd`` the weight-decay coefficient and ``c`` its centre (``wd_center``): ``None`` is ordinary weight decay
(c = 0, what ``torch.optim.SGD(weight_decay=wd)`` minimises, the default), a dict of tensors a pull toward a
known start w_0 (scrubnet's own fine-tuning protocol, :meth:`TrainingRecipe.scrubnet_protocol`). The optimiser
settings (optimizer, schedule, lr, momentum, batch_size, epochs, freeze_bn) say how the model *was trained*: the
faithful retraining (:func:`~scrubnet.recipe.retrain.retrain_like_user`) runs them and the cost reference prices
them; the fine-tuning baselines (Finetune, NegGrad, Random labels) reuse the optimiser at its own rate (an AdamW
rate is never handed to SGD) and train their own number of epochs (a method option).

From it the methods derive Newton's retain objective L_r (the sum above over D_r), the NTK ridge, Fisher's
curvature and the baselines' loss; :meth:`TrainingRecipe.center_for` gives the centre as a dict over a model's
trainable parameters (zeros for ordinary weight decay).

AdamW's decoupled decay is not an L2 term of the same coefficient: state its L2 equivalent with
:meth:`TrainingRecipe.from_adamw` (:mod:`scrubnet.recipe.adamw`).

A TOML file states a recipe in a ``[recipe]`` table (:meth:`TrainingRecipe.from_toml`)::

    [recipe]
    loss = "cross_entropy"     # or "mse"
    wd = 5e-4                  # ≥ 0
    wd_center = "zero"         # or the path of a safetensors file holding w_0 (relative to the TOML file)
    target_scale = 1.0         # s of the MSE target s·onehot(y) (loss = "mse" only)
    label_smoothing = 0.0      # ε of the CE target (1 − ε)·onehot(y) + ε/c (loss = "cross_entropy" only)
    lr = 0.01                  # the (peak) step size of the training
    momentum = 0.9
    batch_size = 128
    epochs = 10                # how long the model was trained (the retraining reference runs this)
    optimizer = "sgd"          # or "adamw" (then adamw_weight_decay = its λ, betas = [0.9, 0.999])
    schedule = "constant"      # or "cosine" / "linear" (annealed to 0 over the training's steps)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from scrubnet._config import ConfigValueError, check_table_keys, check_value
from scrubnet.models.loss import LossSpec
from scrubnet.recipe.adamw import adamw_l2_equivalent
from scrubnet.training.loops import TrainConfig

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

#: the losses a recipe can state; the curvature code calls them "ce" and "mse"
RECIPE_LOSSES = {"cross_entropy": "ce", "mse": "mse"}

#: epochs of the fine-tuning baselines in scrubnet's own protocol (the papers' 10)
PROTOCOL_BASELINE_EPOCHS = 10

#: the optimisers and learning-rate schedules a recipe can state (what the faithful retraining runs)
RECIPE_OPTIMIZERS = ("sgd", "adamw")
RECIPE_SCHEDULES = ("constant", "cosine", "linear")

#: allowed ranges of the numeric recipe keys
RECIPE_RANGES = {"wd": ">= 0", "target_scale": "> 0", "label_smoothing": "[0, 1)", "lr": "> 0", "momentum": "[0, 1)",
                 "batch_size": ">= 1", "epochs": ">= 0", "adamw_weight_decay": ">= 0"}


@dataclass(frozen=True)
class TrainingRecipe:
    """The objective and optimiser the model was trained with (module docstring).

    Parameters
    ----------
    loss : {"cross_entropy", "mse"}
        The per-sample loss, averaged over the samples.
    wd : float
        The decay coefficient; objective = mean loss + (wd/2)‖w − c‖².
    wd_center : dict of str to Tensor or None
        c as {parameter name: tensor of that parameter's shape}; ``None`` = 0 (ordinary weight decay).
        Parameters absent from the dict feel no decay.
    target_scale : float
        s of the MSE loss's target s·onehot(y) (1 unless the model was trained like LQF, 15).
    label_smoothing : float
        ε of the cross-entropy's target (1 − ε)·onehot(y) + ε/c (``CrossEntropyLoss(label_smoothing=ε)``, the
        HuggingFace Trainer's ``label_smoothing_factor``); 0 = none.
    lr, momentum : float
        The optimiser's (peak) step size, and SGD's momentum (AdamW: β₁ is :attr:`betas`' first).
    batch_size, epochs : int
        Samples per batch and passes over the data *of the training the model had*: the faithful retraining
        (:func:`~scrubnet.recipe.retrain.retrain_like_user`) runs them and the cost reference prices them. The
        fine-tuning baselines' length is their own option (``epochs``, default 10), not this.
    freeze_bn : bool
        Keep BatchNorm layers in eval mode while training.
    optimizer : {"sgd", "adamw"}
        The optimiser the model was trained with: ``torch.optim.SGD(lr, momentum, weight_decay=wd)`` or
        ``torch.optim.AdamW(lr, betas, weight_decay=adamw_weight_decay)`` (decoupled decay on the decayed
        parameters: the centre's keys when ``wd_center`` is given, else all). :meth:`from_adamw` sets it.
    schedule : {"constant", "cosine", "linear"}
        The learning-rate schedule over the training's optimiser steps: constant, cosine annealing from ``lr``
        to 0 (``CosineAnnealingLR(T_max = total steps)``, stepped per batch), or linear decay to 0 (the
        HuggingFace Trainer's default, without warm-up).
    adamw_weight_decay : float
        AdamW's decoupled λ (``weight_decay=`` of ``torch.optim.AdamW``), what the retraining runs; ``wd`` is
        its L2 equivalent, what the curvature methods read (:mod:`scrubnet.recipe.adamw`). SGD: 0.
    betas : tuple of float
        AdamW's (β₁, β₂).

    Returns
    -------
    TrainingRecipe
        The recipe :meth:`ForgetContext.from_recipe <scrubnet.methods.base.ForgetContext.from_recipe>` and
        :func:`scrubnet.forget` take.
    """

    loss: str = "cross_entropy"
    wd: float = 0.0
    wd_center: dict[str, Tensor] | None = field(default=None, compare=False, repr=False)
    target_scale: float = 1.0
    label_smoothing: float = 0.0
    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 128
    epochs: int = 10
    freeze_bn: bool = False
    optimizer: str = "sgd"
    schedule: str = "constant"
    adamw_weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self):
        if self.loss not in RECIPE_LOSSES:
            raise ValueError(f"recipe loss must be one of {', '.join(RECIPE_LOSSES)}, got {self.loss!r}")
        for key, allowed in (("optimizer", RECIPE_OPTIMIZERS), ("schedule", RECIPE_SCHEDULES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"recipe.{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        if self.optimizer != "adamw" and self.adamw_weight_decay != 0.0:
            raise ValueError(f"recipe.adamw_weight_decay applies to optimizer 'adamw' only, got "
                             f"{self.adamw_weight_decay:g} with {self.optimizer!r}")
        if not (len(self.betas) == 2 and all(0.0 <= float(b) < 1.0 for b in self.betas)):
            raise ValueError(f"recipe.betas must be two numbers in [0, 1), got {self.betas!r}")
        for key, spec in RECIPE_RANGES.items():
            check_value(f"recipe.{key}", getattr(self, key), int if key in ("batch_size", "epochs") else float,
                        spec)
        if self.loss != "mse" and self.target_scale != 1.0:
            raise ValueError(f"recipe.target_scale applies to the MSE loss only, got {self.target_scale:g} with "
                             f"{self.loss!r}")
        if self.loss != "cross_entropy" and self.label_smoothing != 0.0:
            raise ValueError(f"recipe.label_smoothing applies to the cross-entropy loss only, got "
                             f"{self.label_smoothing:g} with {self.loss!r}")
        if self.wd_center is not None:
            if not isinstance(self.wd_center, dict) or not all(isinstance(v, Tensor) for v in self.wd_center.values()):
                raise TypeError("recipe.wd_center must be None or a dict of tensors (parameter name → w_0)")
            bad = [k for k, v in self.wd_center.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
            if bad:
                raise ValueError(f"recipe.wd_center has non-finite values in {', '.join(bad[:3])}")

    # ----------------------------------------------------------------- derived quantities
    @property
    def curvature_loss(self) -> str:
        """The loss as the curvature code names it: ``"ce"`` or ``"mse"``."""
        return RECIPE_LOSSES[self.loss]

    @property
    def loss_spec(self) -> LossSpec:
        """The per-sample loss (kind, target scale, label smoothing) every objective and gradient uses."""
        return LossSpec(self.curvature_loss, self.target_scale, self.label_smoothing)

    def loss_fn(self, logits: Tensor, y: Tensor) -> Tensor:
        """The recipe's mean loss of ``logits`` (N, c) against labels ``y`` (N,): a scalar tensor."""
        return self.loss_spec.mean(logits, y)

    @property
    def pulls_to_start(self) -> bool:
        """True when the decay pulls toward a given w_0 rather than toward 0."""
        return self.wd_center is not None

    @property
    def center_is_zero(self) -> bool:
        """True when the decay pulls toward 0 (no centre, or a centre of zeros on the decayed parameters only)."""
        return self.wd_center is None or all(not bool(v.any()) for v in self.wd_center.values())

    def describe(self) -> str:
        """The objective in words, e.g. ``mean CE + (0.03/2)‖w − w_0‖²``."""
        data = "mean " + self.loss_spec.describe()
        if self.wd == 0:
            return data
        if self.center_is_zero:
            return f"{data} + ({self.wd:g}/2)‖w{'_decayed' if self.pulls_to_start else ''}‖²"
        return f"{data} + ({self.wd:g}/2)‖w − w_0‖²"

    def center_for(self, model: nn.Module) -> dict[str, Tensor]:
        """c over ``model``'s trainable parameters: the given w_0 (checked: names present, shapes equal), or
        zeros for ordinary weight decay. Parameters missing from a given ``wd_center`` are left out (no decay);
        its entries naming buffers (BatchNorm statistics) or frozen parameters are ignored, so a whole
        ``state_dict()`` may serve as the centre file."""
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        if self.wd_center is None:
            return {k: torch.zeros_like(p, requires_grad=False) for k, p in params.items()}
        not_trained = {k for k, _ in model.named_buffers()} | {k for k, p in model.named_parameters()
                                                               if not p.requires_grad}
        unknown = sorted(set(self.wd_center) - set(params) - not_trained)
        if unknown:
            raise ValueError(f"recipe.wd_center names tensors the model has no trainable parameter for: "
                             f"{', '.join(unknown[:3])}" + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""))
        out = {}
        for k, v in self.wd_center.items():
            if k not in params:
                continue
            if tuple(v.shape) != tuple(params[k].shape):
                raise ValueError(f"recipe.wd_center[{k!r}] has shape {tuple(v.shape)}, the parameter "
                                 f"{tuple(params[k].shape)}")
            out[k] = v.detach().to(params[k].device, params[k].dtype)
        return out

    def train_config(self, base: TrainConfig | None = None) -> TrainConfig:
        """A :class:`TrainConfig` carrying this recipe's fine-tuning settings (other fields from ``base``)."""
        base = base or TrainConfig()
        return replace(base, lr=self.lr, momentum=self.momentum, wd=self.wd, batch_size=self.batch_size,
                       freeze_bn=self.freeze_bn)

    # ----------------------------------------------------------------- constructors
    @classmethod
    def scrubnet_protocol(cls, w0: dict[str, Tensor], config: TrainConfig) -> "TrainingRecipe":
        """scrubnet's own fine-tuning: mean CE + (config.wd/2)‖w − w_0‖², SGD at config's lr, momentum and
        batch size with frozen BatchNorm as configured; baselines train :data:`PROTOCOL_BASELINE_EPOCHS`."""
        return cls(loss="cross_entropy", wd=float(config.wd), wd_center=w0, lr=float(config.lr),
                   momentum=float(config.momentum), batch_size=int(config.batch_size),
                   epochs=PROTOCOL_BASELINE_EPOCHS, freeze_bn=bool(config.freeze_bn))

    @classmethod
    def from_adamw(cls, model: nn.Module, optimizer: torch.optim.Optimizer, **settings) -> "TrainingRecipe":
        """The recipe of a model trained with ``torch.optim.AdamW`` (or the HuggingFace Trainer's AdamW).

        Parameters
        ----------
        model : the trained model.
        optimizer : its AdamW optimiser with the state at the end of training (:func:`adamw_l2_equivalent`).
        **settings : other recipe fields (``loss``, ``label_smoothing``, ``batch_size``, ``epochs`` …).

        Returns
        -------
        TrainingRecipe
            ``wd`` = the L2 equivalent of the decoupled decay (not its ``weight_decay``), the centre zero on the
            decayed parameters only (groups with ``weight_decay = 0`` feel none), ``lr`` the first group's (its
            ``initial_lr`` under a scheduler), ``optimizer="adamw"`` with the groups' λ as ``adamw_weight_decay``
            and their ``betas`` (state ``schedule="cosine"`` in ``settings`` for a cosine-annealed training).
        """
        wd, decayed, _ = adamw_l2_equivalent(model, optimizer)
        trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
        center = None if wd == 0.0 or decayed == set(trainable) else {
            k: torch.zeros_like(p.detach()) for k, p in trainable.items() if k in decayed}
        group = optimizer.param_groups[0]
        lr = float(group.get("initial_lr", group["lr"]))
        if lr > 0:  # a schedule annealed to 0 leaves lr = 0; its start is in initial_lr
            settings.setdefault("lr", lr)
        settings.setdefault("optimizer", "adamw")
        settings.setdefault("adamw_weight_decay", max((float(g["weight_decay"]) for g in optimizer.param_groups),
                                                      default=0.0))
        settings.setdefault("betas", tuple(float(b) for b in group.get("betas", (0.9, 0.999))))
        settings.setdefault("momentum", float(settings["betas"][0]))
        return cls(wd=wd, wd_center=center, **settings)

    @classmethod
    def from_dict(cls, d: dict, base_dir: str | Path = ".", prefix: str = "recipe.") -> "TrainingRecipe":
        """A recipe from a ``[recipe]`` table: unknown keys, wrong types and out-of-range values are refused
        with a message naming the key; ``wd_center`` is ``"zero"`` or a safetensors path (relative paths
        resolve against ``base_dir``)."""
        check_table_keys(cls, d, "recipe", prefix)
        kwargs: dict = {}
        if "loss" in d:
            loss = check_value(prefix + "loss", d["loss"], str)
            if loss not in RECIPE_LOSSES:
                raise ConfigValueError(f"configuration key {prefix}loss: expected one of "
                                       f"{', '.join(repr(k) for k in RECIPE_LOSSES)}, got {loss!r}")
            kwargs["loss"] = loss
        for key, spec in RECIPE_RANGES.items():
            if key in d:
                kwargs[key] = check_value(prefix + key, d[key], int if key in ("batch_size", "epochs") else float,
                                          spec)
        if "freeze_bn" in d:
            kwargs["freeze_bn"] = check_value(prefix + "freeze_bn", d["freeze_bn"], bool)
        for key, allowed in (("optimizer", RECIPE_OPTIMIZERS), ("schedule", RECIPE_SCHEDULES)):
            if key in d:
                value = check_value(prefix + key, d[key], str)
                if value not in allowed:
                    raise ConfigValueError(f"configuration key {prefix}{key}: expected one of "
                                           f"{', '.join(repr(k) for k in allowed)}, got {value!r}")
                kwargs[key] = value
        if "betas" in d:
            betas = d["betas"]
            if not (isinstance(betas, list) and len(betas) == 2 and all(isinstance(b, (int, float)) and
                                                                        not isinstance(b, bool) and 0 <= b < 1
                                                                        for b in betas)):
                raise ConfigValueError(f"configuration key {prefix}betas: expected two numbers in [0, 1), got "
                                       f"{betas!r}")
            kwargs["betas"] = (float(betas[0]), float(betas[1]))
        if "wd_center" in d:
            center = check_value(prefix + "wd_center", d["wd_center"], str)
            if center != "zero":
                path = Path(center)
                if not path.is_absolute():
                    path = Path(base_dir) / path
                if not path.is_file():
                    raise ConfigValueError(f"configuration key {prefix}wd_center: expected \"zero\" or the path of "
                                           f"a safetensors file holding w_0, got {center!r} (no file {path})")
                try:
                    kwargs["wd_center"] = load_file(str(path))
                except Exception as e:  # safetensors raises its own error types on a bad header
                    raise ConfigValueError(f"configuration key {prefix}wd_center: cannot read {path} as "
                                           f"safetensors ({e})") from None
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> "TrainingRecipe":
        """The ``[recipe]`` table of the TOML file ``path`` (:meth:`from_dict`, paths relative to the file)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"recipe file not found: {path}")
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigValueError(f"{path} is not valid TOML: {e}") from None
        if "recipe" not in doc:
            raise ConfigValueError(f"{path} has no [recipe] table")
        extra = sorted(set(doc) - {"recipe"})
        if extra:
            raise ValueError(f"unknown table(s) or key(s) in {path}: {', '.join(extra)} (only [recipe] is read)")
        return cls.from_dict(doc["recipe"], base_dir=path.parent)

    def to_dict(self) -> dict:
        """The recipe's scalar settings (``wd_center`` as ``"zero"`` or ``"given"``) for reports and sidecars."""
        return {"loss": self.loss, "wd": self.wd, "wd_center": "given" if self.pulls_to_start else "zero",
                "target_scale": self.target_scale, "label_smoothing": self.label_smoothing,
                "lr": self.lr, "momentum": self.momentum, "batch_size": self.batch_size, "epochs": self.epochs,
                "freeze_bn": self.freeze_bn, "optimizer": self.optimizer, "schedule": self.schedule,
                "adamw_weight_decay": self.adamw_weight_decay, "betas": list(self.betas)}
