"""Scrubbing and evaluating the user's own model (what ``scrubnet forget`` and ``scrubnet evaluate`` run for
``--model``): the model from ``--model FILE.py:FACTORY`` (or
``MODULE:FACTORY``), ``--weights`` (safetensors or a ``torch.save`` state_dict), ``--data`` (an ``.npz`` or an
image folder) and ``--recipe R.toml`` (how the model was trained, :class:`scrubnet.TrainingRecipe`).

No core/task split and no sidecar are needed on input. What scrubnet writes — the scrubbed weights as
safetensors — gets its sidecar (:mod:`scrubnet.checkpoint`): the weights' sha256, the data fingerprint, the
recipe (with the sha256 of a given decay centre), the method and its options, the forget ids, the factory
(and its file's sha256) and the source weights' sha256. A scrub whose result is not ``ok`` writes nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from scrubnet.api import forget as scrub_model
from scrubnet.checkpoint import read_meta, save_checkpoint, sidecar_path, state_sha256, weights_sha256
from scrubnet.data.splits import validate_forget_ids
from scrubnet.data.user import UserData, load_user_data
from scrubnet.methods.base import ForgetContext
from scrubnet.recipe.objective import RecipeMismatch
from scrubnet.models.call import ModelInputs, call_model
from scrubnet.models.user import (USER_ARCH, UserModelError, build_user_model, factory_source_sha256, load_factory,
                                  load_user_weights, read_state_dict)
from scrubnet.readouts.basic import activation_l1, error_and_loss
from scrubnet.readouts.references import load_references, train_references
from scrubnet.recipe import TrainingRecipe
from scrubnet.recipe.retrain import retrain_like_user
from scrubnet.tuning.profile import TunedProfile, resolve_profile


class OwnModelError(ValueError):
    """A problem with the user's model, data or scrub, reported as one ``error:`` line."""


def load_own_model(spec: str, options: dict[str, Any], weights: Path, what: str = "--weights"
                   ) -> tuple[nn.Module, dict | None]:
    """(model with the weights loaded, the weights' scrubnet sidecar or None). A sidecar next to the weights
    (written by ``scrubnet forget``) must match the file's sha256."""
    model = build_user_model(spec, options)
    state = read_state_dict(weights)
    meta = None
    if sidecar_path(weights).is_file():
        meta = read_meta(weights)
        if state_sha256(Path(weights).read_bytes()) != meta.get("sha256"):
            raise OwnModelError(f"{what} {weights} was modified after scrubnet wrote it: its sha256 does not "
                                f"match its sidecar {sidecar_path(weights).name}")
    return load_user_weights(model, state, f"{what} {weights}"), meta


def describe_inputs(x) -> str:
    """The inputs' fields with dtype and per-sample shape, e.g. ``x int64 (8,), attention_mask int64 (8,)``."""
    fields = {"x": x.main, **x.extras} if isinstance(x, ModelInputs) else {"x": x}
    return ", ".join(f"{k} {str(v.dtype).replace('torch.', '')} {tuple(v.shape[1:])}" for k, v in fields.items())


def num_outputs(model: nn.Module, x) -> int:
    """The model's number of classes, read from its output on two samples (also checks it takes the data)."""
    try:
        with torch.no_grad():
            out = call_model(model.eval(), x[:2])
    except TypeError as e:
        if "scrubnet reads logits" in str(e):
            raise OwnModelError(str(e)) from None
        raise OwnModelError(f"the model cannot take the data's inputs ({describe_inputs(x)}): "
                            f"TypeError: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's forward may raise anything on a wrong shape or dtype
        raise OwnModelError(f"the model cannot take the data's inputs ({describe_inputs(x)}): "
                            f"{type(e).__name__}: {e}") from None
    if out.ndim != 2 or out.shape[1] < 2:
        raise OwnModelError(f"the model must return logits of shape (batch, classes ≥ 2), got {tuple(out.shape)}")
    return int(out.shape[1])


def whole_class(y: Tensor, idx: Tensor) -> int | None:
    """The class c when D_f is exactly the samples of class c in D, else None."""
    classes = y[idx].unique()
    if len(classes) != 1:
        return None
    c = int(classes[0])
    return c if int((y == c).sum()) == len(idx) else None


def recipe_record(recipe: TrainingRecipe, path: Path | None) -> dict:
    """The recipe as the sidecar records it: its settings, the file, and the sha256 of a given decay centre."""
    rec = dict(recipe.to_dict(), file=str(path) if path else None)
    if recipe.wd_center is not None:
        rec["wd_center_sha256"] = weights_sha256(recipe.wd_center)
    return rec


def load_user_training(spec: str):
    """The user's training function ``train(model, data) -> model`` named by ``--train FILE.py:FUNCTION`` (or
    ``MODULE:FUNCTION``): imports (executes) the user's file, as ``--model`` does; a problem is one
    :class:`OwnModelError` naming ``--train``."""
    try:
        return load_factory(spec)
    except UserModelError as e:
        raise OwnModelError(str(e).replace("--model", "--train")) from None


def _load_all(spec, options, weights, data, device) -> tuple[nn.Module, dict | None, UserData, int]:
    model, meta = load_own_model(spec, options, weights)
    ud = load_user_data(data)
    c = num_outputs(model, ud.x)
    ud.check_labels(c)
    return model.to(device), meta, ud, c


def forget_own(*, spec: str, options: dict[str, Any], weights: Path, data: Path, forget_ids: list[int], method: str,
               method_options: dict[str, Any], recipe_path: Path | None, out: Path, seed: int, force: bool,
               device: torch.device, before_scrub=None, on_not_forgotten: str = "fail",
               train_spec: str | None = None, profile: TunedProfile | None = None,
               references: Path | None = None) -> dict | None:
    """Scrub D_f (``forget_ids``: positions in x_train) from the user's model and write ``out`` (+ sidecar);
    returns the sidecar.
    A failed scrub (result not ok, or the method's refusal) raises :class:`OwnModelError`; nothing is written.
    ``before_scrub(model, retain, forget, ctx)`` (ctx: the call's :class:`~scrubnet.methods.base.ForgetContext`)
    runs once the inputs are loaded and checked (the CLI's cost estimate and budgets); when it returns True
    nothing is scrubbed or written and None is returned.
    With test arrays in ``data`` the scrub gets the forgetting verdict (``on_not_forgotten``: see
    :func:`scrubnet.forget`); the sidecar records it (``forgetting``) and the warnings (``warnings``).
    ``train_spec`` (``--train FILE.py:FUNCTION``): the user's own training, what ``retrain`` runs and the cost
    reference times (:mod:`scrubnet.recipe.retrain`); handed D_r as ``(x, y)`` tensors.
    With a tuned ``profile`` (``--method auto``: ``method`` and ``method_options`` are its choice) the profile
    must be this model's; the sidecar records what it chose and why (``auto``).
    ``references``: the directory ``scrubnet references`` wrote for these weights and data (checked by their
    sha256 and fingerprint): the verdict's scores are calibrated by them."""
    recipe = TrainingRecipe.from_toml(recipe_path) if recipe_path is not None else TrainingRecipe()
    train = load_user_training(train_spec) if train_spec is not None else None
    model, _, ud, c = _load_all(spec, options, weights, data, device)
    refs = None if references is None else _own_references(references, model, weights, ud)
    if profile is not None:
        try:
            resolve_profile(profile, model)
        except ValueError as e:
            raise OwnModelError(f"--profile: {e}") from None
    idx = validate_forget_ids(forget_ids, len(ud.y))
    keep = torch.ones(len(ud.y), dtype=torch.bool)
    keep[idx] = False
    retain = (ud.x[keep].to(device), ud.y[keep].to(device))
    forget_set = (ud.x[idx].to(device), ud.y[idx].to(device))
    if before_scrub is not None:
        ctx = ForgetContext.from_recipe(model, recipe, num_classes=c, seed=seed, forget_class=whole_class(ud.y, idx),
                                        train=train)
        ctx.force = bool(force)
        if before_scrub(model, retain, forget_set, ctx):
            return None
    test = None if ud.x_test is None else (ud.x_test.to(device), ud.y_test.to(device))
    try:   # with a profile the request runs as "auto": its self-check may take the profile's next step
        scrubbed, result = scrub_model(model, retain, forget_set, method=method if profile is None else "auto",
                                       recipe=recipe, seed=seed, on_failure="return", num_classes=c,
                                       forget_class=whole_class(ud.y, idx), force=force, test=test,
                                       on_not_forgotten=on_not_forgotten, train=train, profile=profile,
                                       references=refs if test is not None else None,
                                       forget_ids=idx.tolist() if refs is not None and test is not None else None,
                                       **method_options)
    except RecipeMismatch as e:  # the recipe check: name the CLI's flag, not the Python argument
        raise OwnModelError(str(e).replace("pass force=True", "pass --force")) from None
    check = result.checks.get("self_check", {})
    if profile is not None and check.get("result", 0) > 0:     # the self-check's next step is what ran
        final = check["attempts"][check["result"]]
        method, method_options = final["method"], dict(final["options"])
    if not result.ok:
        raise OwnModelError(f"method {method!r} failed: {'; '.join(result.reasons) or 'no reason given'} "
                            f"(nothing written to {out})")
    extra = {"role": "scrubbed", "method": method, "method_options": method_options, "forget_ids": idx.tolist(),
             "recipe": recipe_record(recipe, recipe_path), "factory": spec, "factory_options": options,
             "factory_sha256": factory_source_sha256(spec), "source_weights": str(weights), "train": train_spec,
             "train_sha256": None if train_spec is None else factory_source_sha256(train_spec),
             "source_sha256": state_sha256(Path(weights).read_bytes()), "data": str(data), "ok": True,
             "forgetting": None if result.forgetting is None else result.forgetting.to_dict(),
             "warnings": list(result.warnings), "cost": dict(result.cost), "auto": result.checks.get("auto"),
             "report": {k: float(v) for k, v in result.report.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)}}
    return save_checkpoint(out, scrubbed, arch=USER_ARCH, in_shape=list(ud.x.shape[1:]), num_classes=c,
                           arch_options={"factory": spec, "options": options}, config={"recipe": extra["recipe"]},
                           data_fingerprint=ud.fingerprint, seed=seed, extra=extra)


def _set_readouts(model: nn.Module, sets: dict[str, tuple[Tensor, Tensor]], prefix: str = "") -> dict[str, float]:
    out = {}
    for part, (x, y) in sets.items():
        out[f"{prefix}error_{part}"], out[f"{prefix}loss_{part}"] = error_and_loss(model, x, y)
    return out


def evaluate_own(*, spec: str, options: dict[str, Any], weights: Path, data: Path, forget_ids: list[int] | None,
                 reference: Path | None, device: torch.device) -> dict[str, float]:
    """Error and loss (mean CE) on D_r, D_f and the test set (D and test without forget ids), and with a
    ``reference`` (weights of the same factory, e.g. retrained without D_f) its readouts, the mean L1 distance
    of the two softmax outputs per set (``activation_l1_*``) and the weight distance ‖w − w_ref‖₂.
    Forget ids default to those recorded in the weights' sidecar (when its data fingerprint matches)."""
    model, meta, ud, c = _load_all(spec, options, weights, data, device)
    if meta and meta.get("data_fingerprint") and meta["data_fingerprint"] != ud.fingerprint:
        raise OwnModelError(f"--weights {weights} were scrubbed on other data than {data} (data fingerprints "
                            "differ)")
    if forget_ids is not None:
        idx = validate_forget_ids(forget_ids, len(ud.y))
    elif meta and meta.get("forget_ids"):
        idx = validate_forget_ids(meta["forget_ids"], len(ud.y))
    else:
        idx = None
    sets: dict[str, tuple[Tensor, Tensor]] = {}
    if idx is None:
        sets["train"] = (ud.x, ud.y)
    else:
        keep = torch.ones(len(ud.y), dtype=torch.bool)
        keep[idx] = False
        sets["retain"], sets["forget"] = (ud.x[keep], ud.y[keep]), (ud.x[idx], ud.y[idx])
    if ud.x_test is not None:
        sets["test"] = (ud.x_test, ud.y_test)
    sets = {k: (x.to(device), y.to(device)) for k, (x, y) in sets.items()}
    r = _set_readouts(model, sets)
    if reference is not None:
        ref, _ = load_own_model(spec, options, reference, what="--reference")
        ref = ref.to(device)
        r.update(_set_readouts(ref, sets, prefix="reference_"))
        for part, (x, _) in sets.items():
            r[f"activation_l1_{part}"] = activation_l1(model, ref, x)
        p = {k: v.detach() for k, v in model.named_parameters()}
        q = {k: v.detach() for k, v in ref.named_parameters()}
        r["weight_distance"] = float(torch.sqrt(sum(((p[k] - q[k]).double() ** 2).sum() for k in p)))
    return r


__all__ = ["OwnModelError", "UserModelError", "evaluate_own", "forget_own", "load_own_model"]


def references_dir(weights: Path) -> Path:
    """Where ``scrubnet references`` stores a model's reference models by default: beside its weights."""
    return Path(str(weights) + ".references")


def _own_references(directory: Path, model: nn.Module, weights: Path, ud: UserData):
    """The reference models in ``directory``, refused (one error line) unless they were trained for these
    weights (sha256) on this data (fingerprint)."""
    try:
        refs = load_references(directory, model)
    except ValueError as e:
        raise OwnModelError(f"--references: {e}") from None
    meta, sha = refs.meta, state_sha256(Path(weights).read_bytes())
    if meta.get("source_sha256") != sha or meta.get("data_fingerprint") != ud.fingerprint:
        raise OwnModelError(f"--references {directory} were trained for other weights or data (their sha256 "
                            f"{str(meta.get('source_sha256'))[:12]}…, these {sha[:12]}…): train them for this "
                            "model with `scrubnet references`")
    if refs.members.shape[1] != len(ud.y):
        raise OwnModelError(f"--references {directory} split {refs.members.shape[1]} training examples, the data "
                            f"holds {len(ud.y)}")
    return refs


def train_own_references(*, spec: str, options: dict[str, Any], weights: Path, data: Path,
                         recipe_path: Path | None, out: Path, pairs: int, seed: int, device: torch.device,
                         train_spec: str | None = None) -> dict:
    """Train ``2·pairs`` reference models of the user's model (each on a random half of x_train, the way the
    user trained it: ``--train``, else the recipe reproduced) and write them to ``out``; returns the index
    (count, cost in seconds, the weights' sha256 and the data fingerprint they belong to)."""
    recipe = TrainingRecipe.from_toml(recipe_path) if recipe_path is not None else TrainingRecipe()
    train = load_user_training(train_spec) if train_spec is not None else None
    model, _, ud, _ = _load_all(spec, options, weights, data, device)
    x, y = ud.x.to(device), ud.y.to(device)

    def fit(idx, s):
        sel = torch.as_tensor(idx, dtype=torch.long, device=device)
        return retrain_like_user(model, (x[sel], y[sel]), train=train, recipe=recipe, seed=s)

    refs = train_references(fit, len(y), pairs=pairs, seed=seed)
    refs.save(out, {"source_sha256": state_sha256(Path(weights).read_bytes()), "data_fingerprint": ud.fingerprint,
                    "factory": spec, "train": train_spec, "recipe": recipe_record(recipe, recipe_path)})
    return {"models": len(refs.models), "seconds": refs.seconds, "out": str(out)}
