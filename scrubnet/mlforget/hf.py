"""Forgettable fine-tuning as HuggingFace users fine-tune: a ``transformers.Trainer`` whose ``train()`` fits
the user weights forgettably, and whose output directory is a scrubnet checkpoint.

    from scrubnet.mlforget.hf import ForgettableArguments, ForgettableTrainer

    trainer = ForgettableTrainer(model=model, args=TrainingArguments(output_dir="ft-out", report_to=[]),
                                 train_dataset=train, peft_config=LoraConfig(r=4, target_modules=["query", "value"],
                                                                             modules_to_save=["classifier"]),
                                 forgettable=ForgettableArguments(mu=1e-3))
    trainer.train()          # the exact minimiser instead of SGD; ft-out/ is the checkpoint

then ``scrubnet mlforget forget ft-out --ids 3,17``, ``show`` and ``scrubnet serve ft-out`` work on it.

What ``train()`` does, in place of the optimiser loop: every sample of ``train_dataset`` (its position is its
id in deletion requests) is collated once by the trainer's ``data_collator`` (the model's forward arguments
kept, labels read from ``labels``/``label``); the model (a ``PeftModel``'s base model, its ``LoraConfig`` the
user weights, or the model with ``peft_config=`` or ``ForgettableArguments.user_weights``) is saved with
``save_pretrained`` and the data as ``.npz``, both *inside* the output directory (``base/``, ``data.npz``: the
checkpoint is self-contained and can be moved); the base model is read back from there and cast to float64,
and :func:`~scrubnet.mlforget.finetune.forgettable_finetune` fits the user weights on those exact arrays — so a
deletion request to the checkpoint equals this same fine-tuning run without those rows. ``eval_dataset``, when
given, is scored after the fit (``eval_accuracy`` in the metrics). The output directory must not exist or be
empty; ``save_model`` afterwards leaves the checkpoint alone. ``transformers`` (and ``peft`` for a
``PeftModel`` or ``peft_config``) come with the ``hf`` extra and are imported only when the trainer is built.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from scrubnet.data.user import load_user_data
from scrubnet.mlforget.finetune import UserWeights, accuracy, split_batch, state_dict_sha256
from scrubnet.mlforget.preflight import answer_token_task, fit_engine, memorisation_decision, preflight
from scrubnet.mlforget.sharded import ENGINE as SHARDED
from scrubnet.mlforget.store import save_new
from scrubnet.mlforget.ftstore import (FINETUNE_ARCH, base_record, cast_inputs, finetune_record, load_base,
                                      main_input)
from scrubnet.models.call import ModelInputs, call_model
from scrubnet.models.lora import LoRA

#: the names of the base model's directory and of the data file inside the checkpoint
BASE_DIR, DATA_FILE = "base", "data.npz"


@dataclasses.dataclass
class ForgettableArguments:
    """The forgettable fit's settings (:func:`~scrubnet.mlforget.finetune.forgettable_finetune`).

    Parameters
    ----------
    mu : float or "auto"
        µ of the ridge; ``"auto"``: picked on held-out samples.
    target_scale : float
        s of the s·one-hot regression target.
    sigma : float
        Default noise std of deletion requests.
    solver : str
        'auto', 'primal' or 'cg'.
    dtype : str
        'float64' (exact deletions) or 'float32'.
    user_weights : LoRA, list of str or "head", optional
        When the trainer gets neither a ``PeftModel`` nor ``peft_config`` (default then: "head").
    core_ids : list of int, optional
        Samples never deleted (the point of linearisation is fine-tuned on them, checked against the
        pretrained point).
    core_lr, core_epochs : the core fine-tuning's Adam rate and epochs.
    check_core : bool
        Drop a core that makes the model worse on held-out samples.
    seed : int, optional
        Default: ``TrainingArguments.seed``.
    strategy : str
        The exact engine: 'linearised', 'sharded' (ordinary fine-tuning of isolated adapters,
        :mod:`scrubnet.mlforget.sharded`) or 'auto' (a pre-flight on held-out data chooses,
        :mod:`scrubnet.mlforget.preflight`; ``train()``'s metrics and the checkpoint say why).
    shards, slices, epochs, lr, batch_size, aggregate : the sharded engine's settings.
    tolerance : float
        'auto': the largest held-out error gap (linearised − ordinary) that keeps the linearised engine.
        Whatever the engine, a model whose held-out error lies within the chance interval is refused
        (:mod:`scrubnet.mlforget.chance`): ``train()`` raises ``ValueError`` and writes nothing.
    task : str
        'generalisation' (the guard scores held-out samples) or 'memorisation' (facts about the training
        people: the guard scores the model that answers on its own training answers; ``auto`` then takes the
        sharded engine; :func:`scrubnet.mlforget.preflight.fit_engine`).
    """

    mu: object = 1e-3
    target_scale: float = 5.0
    sigma: float = 1e-4
    solver: str = "auto"
    dtype: str = "float64"
    user_weights: object = None
    core_ids: list | None = None
    core_lr: float = 1e-3
    core_epochs: int = 40
    check_core: bool = True
    seed: int | None = None
    strategy: str = "linearised"
    shards: int = 4
    slices: int = 4
    epochs: int = 20
    lr: float = 1e-3
    batch_size: int = 32
    aggregate: str = "mean"
    tolerance: float = 0.02
    task: str = "generalisation"


def base_and_user_weights(model, peft_config=None, user_weights: UserWeights | None = None):
    """(the base model, the user weights) of what a trainer was given: a ``PeftModel`` (its adapters
    removed from a copy, its ``LoraConfig`` the user weights), ``peft_config`` (a ``LoraConfig``), or
    ``user_weights`` (default "head").

    Parameters
    ----------
    model : nn.Module
        A transformers model or a ``PeftModel``; never modified.
    peft_config : peft.LoraConfig, optional
    user_weights : LoRA, list of str or "head", optional

    Returns
    -------
    (nn.Module, UserWeights)
    """
    given = [v is not None for v in (peft_config, user_weights)] + [hasattr(model, "peft_config")]
    if sum(given) > 1:
        raise ValueError("give the user weights once: a PeftModel, peft_config= or user_weights=")
    if hasattr(model, "peft_config"):  # a PeftModel: its LoRA config, and the model without the adapters
        cfg = model.peft_config[getattr(model, "active_adapter", "default")]
        return copy.deepcopy(model).unload(), LoRA.from_peft(cfg)
    if peft_config is not None:
        return model, LoRA.from_peft(peft_config)
    return model, "head" if user_weights is None else user_weights


def collate_all(dataset, collator, model) -> dict:
    """Every sample of ``dataset`` (in order) collated at once: the model's forward arguments and the labels,
    as numpy arrays."""
    batch = collator([dataset[i] for i in range(len(dataset))])
    accepted = set(inspect.signature(model.forward).parameters)
    out = {}
    for k, v in batch.items():
        if k in ("labels", "label") or k in accepted:
            out["labels" if k == "label" else k] = torch.as_tensor(v).numpy()
    if "labels" not in out:
        raise ValueError("the training samples hold no labels ('labels' or 'label')")
    return out


def write_npz(path: Path, batch: dict) -> None:
    """The collated batch as a scrubnet ``.npz`` (``x_train`` = the main input, ``train_<name>`` the others)."""
    x, y = split_batch({k: torch.as_tensor(v) for k, v in batch.items()})
    arrays = {"x_train": main_input(x).numpy(), "y_train": y.numpy()}
    if isinstance(x, ModelInputs):
        arrays.update({f"train_{k}": v.numpy() for k, v in x.extras.items()})
    np.savez(path, **arrays)


def fit_checkpoint(out: Path, base_model, spec: UserWeights, batch: dict, fa: ForgettableArguments, seed: int):
    """Write the self-contained checkpoint ``out`` (module docstring); returns the fitted state."""
    if out.exists():
        if not out.is_dir() or any(out.iterdir()):
            raise ValueError(f"output_dir {out} exists and is not empty; the checkpoint needs a new directory")
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".stage"))
    try:
        base_model.save_pretrained(stage / BASE_DIR)
        write_npz(stage / DATA_FILE, batch)
        base = base_record(f"hf:{stage / BASE_DIR}", stage / BASE_DIR / "model.safetensors", None, fa.dtype)
        net = load_base(base)
        ud = load_user_data(stage / DATA_FILE)
        x = cast_inputs(ud.x, fa.dtype)
        if ud.y.dim() == 2:  # a causal LM: token labels, the classes are the vocabulary
            c = int(net.config.vocab_size) if hasattr(net, "config") else int(ud.y.max()) + 1
        else:
            c = int(net.config.num_labels) if hasattr(net, "config") else int(ud.y.max()) + 1
        ud.check_labels(c)
        engine, decision = fa.strategy, None
        if engine == "auto" and fa.task == "memorisation":
            decision = memorisation_decision()
            engine = decision["engine"]
        elif engine == "auto":
            decision = preflight(net, x, ud.y, c, user_weights=spec, tolerance=fa.tolerance,
                                 target_scale=fa.target_scale, solver=fa.solver, seed=seed,
                                 budget={"epochs": fa.epochs, "lr": fa.lr, "batch_size": fa.batch_size})
            engine = decision["engine"]
        state = fit_engine(engine, net, x, ud.y, c, user_weights=spec, seed=seed,
                           sharded={"shards": fa.shards, "slices": fa.slices, "epochs": fa.epochs, "lr": fa.lr,
                                    "batch_size": fa.batch_size, "aggregate": fa.aggregate},
                           linearised={"mu": fa.mu, "target_scale": fa.target_scale, "sigma": fa.sigma,
                                       "solver": fa.solver, "core_ids": fa.core_ids,
                                       "core_train": {"lr": fa.core_lr, "epochs": fa.core_epochs},
                                       "check_core": fa.check_core}, task=fa.task)
        if engine == SHARDED:
            state.base_sha256, state.user_weights = state_dict_sha256(net), state.model.spec
        state.base_sha256 = state_dict_sha256(net)  # the saved model's, also when read through its label words
        record = finetune_record(base, state, stage / DATA_FILE, stage,  # relative: base/…, data.npz
                                 engine=engine, task_kind=fa.task, preflight=decision)
        if decision is not None:
            state.train_info["preflight"] = decision
        root = out.resolve()
        record["absolute"] = {"model": f"hf:{root / BASE_DIR}", "weights": str(root / BASE_DIR / "model.safetensors"),
                              "data": str(root / DATA_FILE)}
        save_new(out, state, arch=FINETUNE_ARCH, in_shape=list(main_input(x).shape[1:]),
                 data_fingerprint=ud.fingerprint, extra={"finetune": record},
                 files={BASE_DIR: stage / BASE_DIR, DATA_FILE: stage / DATA_FILE})
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return state, x, ud.y


def _trainer_class():
    import transformers
    from transformers.trainer_utils import TrainOutput

    class ForgettableTrainer(transformers.Trainer):
        """A ``transformers.Trainer`` whose ``train()`` fine-tunes forgettably (module docstring).

        Parameters
        ----------
        *args, **kwargs
            Those of ``transformers.Trainer`` (``model``, ``args``, ``train_dataset``, ``eval_dataset``,
            ``data_collator``, ``processing_class``, …).
        forgettable : ForgettableArguments, optional
        peft_config : peft.LoraConfig, optional
            The adapter (user weights) when ``model`` is not a ``PeftModel``.
        """

        def __init__(self, *args, forgettable: ForgettableArguments | None = None, peft_config=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.forgettable = forgettable or ForgettableArguments()
            self.peft_config = peft_config
            self.forgettable_state = None

        def train(self, *args, **kwargs):
            """Fit the user weights forgettably; write the checkpoint to ``args.output_dir``.

            Returns
            -------
            transformers.trainer_utils.TrainOutput
                ``global_step`` 0 (no optimiser steps), the metrics: samples, user weights, µ, solver, and
                ``eval_accuracy`` with an ``eval_dataset``.
            """
            fa = self.forgettable
            base, spec = base_and_user_weights(self.model, self.peft_config, fa.user_weights)
            batch = collate_all(self.train_dataset, self.data_collator, base)
            seed = self.args.seed if fa.seed is None else fa.seed
            state, _, _ = fit_checkpoint(Path(self.args.output_dir), base, spec, batch, fa, seed)
            self.forgettable_reason = (state.train_info.get("preflight") or {}).get("reason")
            self.forgettable_state = state
            metrics = {"train_samples": int(len(state.user_ids)), "user_weights": int(state.model.num_linearized),
                       "mu": float(state.config.mu), "core_samples": int(len(state.core_ids)),
                       "engine": getattr(state.model, "engine", "linearised")}
            if fa.strategy == "auto":
                metrics["strategy_reason"] = self.forgettable_reason
            if self.eval_dataset is not None:
                ev = collate_all(self.eval_dataset, self.data_collator, base)
                xe, ye = split_batch({k: torch.as_tensor(v) for k, v in ev.items()})
                xe = cast_inputs(xe, fa.dtype)
                task = state.train_info.get("task")
                if ye.dim() == 2 and task is not None:  # the linearised engine's label-word view of a causal LM
                    found = answer_token_task(xe, ye, task["label_tokens"])
                    if found is not None:
                        metrics["eval_accuracy"] = accuracy(state.model, found[0], found[1])
                elif ye.dim() == 2:  # the sharded engine on a causal LM: every answer token right
                    with torch.no_grad():
                        pred = call_model(state.model, xe)[:, :-1].argmax(-1)
                    lab = ye[:, 1:]
                    metrics["eval_accuracy"] = float(((pred == lab) | (lab == -100)).all(1).double().mean())
                else:
                    metrics["eval_accuracy"] = accuracy(state.model, xe, ye)
            self.log(metrics)
            return TrainOutput(0, 0.0, metrics)

        def save_model(self, output_dir=None, _internal_call=False):
            """The output directory is the checkpoint ``train()`` wrote: nothing more is saved into it."""
            if self.forgettable_state is None:
                super().save_model(output_dir, _internal_call)

    return ForgettableTrainer


def __getattr__(name):
    if name == "ForgettableTrainer":  # built on first use: transformers is imported only then
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ForgettableArguments", "ForgettableTrainer", "base_and_user_weights", "collate_all", "fit_checkpoint"]
