"""Forgettable fine-tuning: fine-tune a pretrained model so that every later deletion is exact.

    state = forgettable_finetune(model, x, y, user_weights=LoRA(["query", "value"], rank=4,
                                                                modules_to_save=["classifier"]))
    out = forget_request(state, x, y, ids)        # exact (closed-form downdate), or certified (budget_nats=…)

The pretrained model is the core network: it is never trained on (nor modified by) the user's data. The user
weights w_u are a parameter subset chosen by the user —

* a :class:`~scrubnet.models.lora.LoRA` adapter (peft's convention; the up-projection B is the user weight,
  the down-projection A fixed at random, so that the tangent model at B = 0 is non-degenerate and each
  adapted layer is affine in its B; the head named in ``modules_to_save`` joins B),
* parameter-name prefixes (``["layer4", "fc"]``), or
* ``"head"`` (the classifier, found by name) —

and the model enters them linearly, around the pretrained point (LoRA: B = 0; named layers: their pretrained
values, so the ridge pulls the fine-tuned weights to the pretrained ones):

    f(x) = f_{w_0}(x) + J(x) w_u,     L_D(w_u) = (1/N) Σ ½‖f(x_i) − s·onehot(y_i)‖² + (µ/2)‖w_u‖²,

trained to its exact minimiser by the exact solver its size allows (:mod:`scrubnet.mlforget.solve`: the
primal p×p system in user-weight space, the dual N·c Gram, or float64 CG with its certificate). The result is
an :class:`~scrubnet.mlforget.model.MLState` with no core ids (every sample deletable), so
:func:`~scrubnet.mlforget.model.forget_request` serves deletions, sequentially, each with its account.

**Inputs.** ``x`` is a tensor, a :class:`~scrubnet.models.call.ModelInputs` (main input + extras such as an
attention mask), or a dict batch ``{"input_ids": …, "attention_mask": …, "labels": …}`` (:func:`split_batch`).
With extra inputs the dual (whose Gram engine takes one tensor input) is not used: the primal or CG is.

**Point of linearisation.** By default the pretrained point. With ``core_ids`` — samples the user will never
delete — the user weights are first fine-tuned the ordinary way on them and the model is linearised there
(ML-Forgetting's core; docs/decisions/forgettable.md measures how much of the gap to ordinary fine-tuning this
closes); those samples can then never be deleted.

**Base model.** The sha256 of the pretrained model's ``state_dict`` is kept in ``state.base_sha256``; the
model given is copied, never modified (:func:`state_dict_sha256` checks it).

**Yardstick.** :func:`ordinary_finetune` fine-tunes the same parameter subset the ordinary way (non-linear,
cross-entropy, Adam) for the accuracy comparison.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scrubnet.mlforget.chance import (at_chance, chance_interval, chance_report, held_out_size, held_out_split,
                                      refusal)
from scrubnet.mlforget.model import MLConfig, MLState, train_exact_factored
from scrubnet.mlforget.solve import SolverConfig
from scrubnet.mlforget.user import find_head
from scrubnet.models.call import Inputs, ModelInputs, call_model
from scrubnet.models.linearized import LinearizedModel, select_parameter_names
from scrubnet.models.lora import LoRA, apply_lora, merge_lora

#: what names the user weights: a LoRA adapter, parameter-name prefixes, or "head"
UserWeights = Union[LoRA, list, str]

#: keys of a dict batch read as labels (never passed to the model)
LABEL_KEYS = ("labels", "label", "y")
#: keys of a dict batch read as the main (positional) input, first found
MAIN_KEYS = ("input_ids", "pixel_values", "inputs_embeds", "x")


def state_dict_sha256(model: nn.Module) -> str:
    """sha256 over ``model.state_dict()``: every entry's name, dtype, shape and bytes, in key order.

    Parameters
    ----------
    model : nn.Module

    Returns
    -------
    str
        64 hex digits; equal for two models exactly when their state_dicts are equal entry by entry.
    """
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def split_batch(data) -> tuple[Inputs, Tensor | None]:
    """(inputs, labels) from a dict batch, a (x, y) pair, or inputs alone (labels None).

    A dict's main input is its first key among :data:`MAIN_KEYS` (else its first non-label key); its other
    non-label entries become the extras of a :class:`ModelInputs`; its labels are read from
    :data:`LABEL_KEYS`.
    """
    if isinstance(data, Mapping):
        labels = next((data[k] for k in LABEL_KEYS if k in data), None)
        keys = [k for k in data if k not in LABEL_KEYS]
        if not keys:
            raise ValueError("the batch holds labels only, no model input")
        main = next((k for k in MAIN_KEYS if k in data), keys[0])
        return ModelInputs(data[main], {k: data[k] for k in keys if k != main}), labels
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    return data, None


def user_weight_names(model: nn.Module, user_weights: UserWeights) -> tuple[nn.Module, list[str], dict]:
    """(network to linearise, its user-weight parameter names, the spec as a dict) for ``user_weights``.

    A :class:`LoRA` gives a copy of ``model`` with adapters (:func:`~scrubnet.models.lora.apply_lora`); names or
    ``"head"`` give a copy of ``model`` and the parameters under those prefixes.
    """
    if isinstance(user_weights, LoRA):
        net, names = apply_lora(model, user_weights)
        return net, names, {"kind": "lora", **user_weights.to_dict()}
    net = copy.deepcopy(model)
    if isinstance(user_weights, str) and user_weights == "head":
        prefixes = [find_head(net)]
        spec = {"kind": "head", "prefixes": prefixes}
    elif isinstance(user_weights, (list, tuple)) or isinstance(user_weights, str):
        prefixes = [user_weights] if isinstance(user_weights, str) else list(user_weights)
        spec = {"kind": "layers", "prefixes": prefixes}
    else:
        raise TypeError(f"user_weights must be a LoRA, a list of layer names or 'head', got "
                        f"{type(user_weights).__name__}")
    return net, select_parameter_names(net, prefixes), spec


def tangent_network(net: nn.Module, names: list[str]) -> LinearizedModel:
    """The linearised network of ``net`` in exactly the parameters ``names``, tangent (user weights) at 0.

    Parameters
    ----------
    net : nn.Module
        The network to linearise (adapters already applied).
    names : list of str
        The user-weight parameter names (:func:`user_weight_names`).

    Returns
    -------
    LinearizedModel
    """
    lin = LinearizedModel(net, prefixes=names)
    lin.linearized_names = list(names)  # exactly the user weights (prefix matching could add more)
    params = dict(lin.base.named_parameters())
    lin.delta = nn.ParameterList([nn.Parameter(torch.zeros_like(params[n])) for n in names])
    return lin


def _check_data(x: Inputs, y: Tensor, num_classes: int | None) -> int:
    if y is None:
        raise ValueError("no labels: give y, or a dict batch with 'labels'")
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"inputs and labels must hold the same positive number of samples, got {len(x)} "
                         f"and {len(y)}")
    main = x.main if isinstance(x, ModelInputs) else x
    if main.is_floating_point() and not bool(torch.isfinite(main).all()):
        raise ValueError("the inputs contain non-finite values (NaN or inf)")
    c = int(num_classes) if num_classes is not None else int(y.max()) + 1
    if int(y.min()) < 0 or int(y.max()) >= c:
        raise ValueError(f"labels must lie in [0, {c}), got [{int(y.min())}, {int(y.max())}]")
    return c


def _solver_config(config: MLConfig | None, names: list[str], extra_inputs: bool, **defaults) -> MLConfig:
    """The state's config: ``config`` (or one from ``defaults``) with the user-weight names, no core fraction,
    and, with extra inputs, the primal-or-CG choice (module docstring)."""
    if config is None:
        config = MLConfig(leaky_slope=None, core_fraction=0.0, **defaults)
    cfg = copy.deepcopy(config)
    cfg.linearize = list(names)
    cfg.core_fraction = 0.0
    if extra_inputs:
        if cfg.solver.solver == "dual":
            raise ValueError("the dual solver takes one tensor input; with extra inputs use 'primal' or 'cg'")
        # 'auto' then picks the primal while its side fits (whatever N), else CG
        cfg.solver.dual_max_rows, cfg.solver.primal_ratio = 0, 0.0
    return cfg


def core_point(model: nn.Module, x: Inputs, y: Tensor, core_ids: Tensor, user_weights: UserWeights,
               core_train: dict | None = None, seed: int = 0) -> tuple[nn.Module, UserWeights, dict]:
    """The point of linearisation fine-tuned the ordinary way on a core set that is never deleted.

    Parameters
    ----------
    model : nn.Module
        The pretrained network (not modified).
    x, y : inputs (N, ...) and labels (N,)
    core_ids : Tensor (k,), int64
        Positions in (x, y) of the core samples.
    user_weights : LoRA, list of str, or "head"
        Fine-tuned on the core by :func:`ordinary_finetune`; a LoRA adapter is then merged into the weights
        (:func:`~scrubnet.models.lora.merge_lora`) and a fresh one (A drawn with ``seed + 1``) is the user weight.
    core_train : dict, optional
        Keyword arguments of :func:`ordinary_finetune` (``lr``, ``epochs``, ``batch_size``, ``weight_decay``).
    seed : int

    Returns
    -------
    (core model, user weights to linearise at it, info with ``core_samples``, ``core_sha256``, the settings)
    """
    opts = {"lr": 1e-2, "epochs": 40, "batch_size": 32, **(core_train or {})}
    core = ordinary_finetune(model, x[core_ids], y[core_ids], user_weights=user_weights, seed=seed, **opts)
    if isinstance(user_weights, LoRA):
        core = merge_lora(core)
        user_weights = dataclasses.replace(user_weights, seed=user_weights.seed + 1)
    return core, user_weights, {"core_samples": int(len(core_ids)), "core_sha256": state_dict_sha256(core), **opts}


def forgettable_finetune(model: nn.Module, x, y: Tensor | None = None, num_classes: int | None = None, *,
                         user_weights: UserWeights = "head", target_scale: float = 5.0, mu: float = 0.05,
                         sigma: float = 1e-4, solver: str = "auto", config: MLConfig | None = None,
                         core_ids=None, core_train: dict | None = None, check_core: bool = True,
                         chance_guard: bool = False, seed: int = 0) -> MLState:
    """Fine-tune ``model`` forgettably on (x, y) (module docstring); returns the trained state.

    Parameters
    ----------
    model : nn.Module
        The pretrained network (a HuggingFace model included); copied, never modified. Its mode is ignored:
        the linearised network runs in eval mode (BatchNorm running statistics, no dropout).
    x : Tensor (N, ...), ModelInputs, dict batch, or (x, y)
        The user data's inputs (:func:`split_batch`).
    y : Tensor (N,), int64, optional
        Labels (read from ``x`` when it is a dict batch or a pair).
    num_classes : int, optional
        c (default: ``max(y) + 1``).
    user_weights : LoRA, list of str, or "head"
    target_scale : float
        s of the s·one-hot regression target.
    mu : float or "auto"
        µ of the ridge (µ/2)‖w_u‖² (mean-normalised loss). ``"auto"``: picked on held-out samples by
        :func:`select_mu` (the choice and the errors in ``state.train_info["mu_search"]``); the default 0.05
        is ML-Forgetting's and far too strong for fine-tuning many samples (docs/decisions/forgettable.md).
    sigma : float
        Default noise std of deletion requests (``config.sigma``).
    solver : str
        'auto' (by size), 'primal', 'dual' or 'cg' (``config.solver.solver``).
    config : MLConfig, optional
        Overrides ``target_scale``, ``mu``, ``sigma`` and ``solver`` when given.
    core_ids : sequence of int, optional
        Samples that will never be deleted: the user weights are first fine-tuned the ordinary way on them
        (:func:`core_point`) and the model is linearised there. They stay in the user data (as ML-Forgetting's
        ``user_data='all'``) and every request naming one is refused.
    core_train : dict, optional
        The core fine-tuning's settings (:func:`core_point`).
    check_core : bool
        With a core: compare the core point with the pretrained point on held-out deletable samples
        (:func:`compare_points`) and, when the core point is worse, linearise at the pretrained point instead,
        every sample deletable (``state.user_weights["core_dropped"]`` and ``train_info["core_check"]`` say
        so). False: linearise at the core point unchecked.
    chance_guard : bool
        With a fixed µ, first fit on the held-out rule's rest and refuse (``ValueError``) when the held-out
        error lies within the chance interval (:mod:`scrubnet.mlforget.chance`; ``train_info["chance_check"]``
        records the check). ``mu="auto"`` always refuses at chance. The command line and the trainer set it.
    seed : int

    Returns
    -------
    MLState
        ``model``: the linearised network (a :class:`LinearizedModel`, user weights = its tangent);
        ``user_ids`` = 0..N−1, ``core_ids`` (empty without a core); ``base_sha256`` (of ``model``),
        ``user_weights`` (the spec, with the core's settings and hash), ``train_info``.
    """
    data_x, data_y = split_batch(x)
    y = data_y if y is None else y
    c = _check_data(data_x, y, num_classes)
    sha = state_dict_sha256(model)
    if isinstance(mu, str) and (mu != "auto" or config is not None):
        raise ValueError(f"mu must be a number > 0 or 'auto' (without config=), got {mu!r}")
    opts = {"target_scale": target_scale, "solver": solver, "seed": seed}
    (net, names, spec), core, check, search = _linearisation_point(model, data_x, y, c, user_weights, core_ids,
                                                                   core_train, check_core, mu, opts)
    if isinstance(mu, str):
        if search is None:
            search = select_mu(net, names, data_x, y, c, core, **opts)[1]
        refuse_near_chance(search)
        mu = search["chosen"]
    fixed_check = None
    if not isinstance(mu, str) and chance_guard:
        n_val = held_out_size(len(y) - len(core))  # ≥ 200, or half of what there is (no least count here)
        if n_val < 1:
            raise ValueError("the chance check holds out half of the deletable samples: give at least 2")
        fixed_check = select_mu(net, names, data_x, y, c, core, grid=(float(mu),), n_held_out=n_val, **opts)[1]
        refuse_near_chance(fixed_check, f"mu={float(mu):g}")
    cfg = _solver_config(config, names, isinstance(data_x, ModelInputs), mu=mu, target_scale=target_scale,
                         sigma=sigma, solver=SolverConfig(solver=solver))
    lin = tangent_network(net, names)
    state = MLState(lin, core, torch.arange(len(y)), torch.zeros(0, dtype=torch.long), cfg, c, int(seed))
    state.base_sha256, state.user_weights = sha, spec
    state.space(data_x)
    train_exact_factored(state, data_x, y, torch.Generator().manual_seed(7919 * int(seed) + 11))
    state.train_info["user_weights"] = int(lin.num_linearized)
    state.train_info.update({k: v for k, v in (("mu_search", search), ("core_check", check),
                                               ("chance_check", fixed_check)) if v is not None})
    if state_dict_sha256(model) != sha:  # the copies above must have left it alone
        raise RuntimeError("the pretrained model changed during fine-tuning")
    return state


def _linearisation_point(model, x, y, c, user_weights, core_ids, core_train, check_core, mu, opts):
    """((network, user-weight names, spec), core positions, core check or None, µ search or None): the
    pretrained point, or the core point (checked against it by :func:`compare_points` unless ``check_core``
    is False; dropped when worse)."""
    core = torch.zeros(0, dtype=torch.long)
    at_pre = user_weight_names(model, user_weights)
    if core_ids is None:
        return at_pre, core, None, None
    core = torch.unique(torch.as_tensor(np.asarray(core_ids, dtype=np.int64).reshape(-1)))
    if not len(core) or int(core.min()) < 0 or int(core.max()) >= len(y) or len(core) >= len(y):
        raise ValueError(f"core_ids must be 1 to {len(y) - 1} distinct positions in [0, {len(y)})")
    start, uw_core, core_info = core_point(model, x, y, core, user_weights, core_train, opts["seed"])
    at_core = user_weight_names(start, uw_core)
    at_core[2]["core"] = core_info
    if not check_core:
        return at_core, core, None, None
    keep, check, search = compare_points(at_core[:2], at_pre[:2], x, y, c, core, mu, **opts)
    if keep:
        return at_core, core, check, search
    at_pre[2]["core_dropped"] = {**check, "core_samples": core_info["core_samples"]}
    return at_pre, torch.zeros(0, dtype=torch.long), check, search  # the pretrained point: all deletable


#: µ values tried by ``mu="auto"`` (the objective is a mean, so the ridge is Nµ: the best µ falls with N)
MU_GRID = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)
#: validation errors this close to the best count as ties, and the largest µ among them is taken
MU_TIE = 0.005


def select_mu(net: nn.Module, names: list[str], x: Inputs, y: Tensor, num_classes: int, core: Tensor, *,
              target_scale: float = 5.0, solver: str = "auto", seed: int = 0, grid=MU_GRID,
              held_out: float | None = None, n_held_out: int | None = None) -> tuple[float, dict]:
    """µ for ``forgettable_finetune(mu="auto")``: held-out error of the forgettable model over ``grid``.

    A seeded held-out split of the deletable samples (never core samples;
    :func:`scrubnet.mlforget.chance.held_out_split`: at least 200, or half of them when fewer, and at least
    10 %) is set aside; the mixed-linear model (the network ``net``, linearised in ``names``) is fitted exactly
    on the rest for each µ (in the primal, one factor and a solve per µ; otherwise a fit per µ), and the
    largest µ whose held-out error is within :data:`MU_TIE` of the best is returned — a larger ridge is better
    conditioned (requests stay exact to more digits) and smaller differences are noise. With a one-value
    ``grid`` this is the held-out check of a fixed µ.

    Parameters
    ----------
    net : nn.Module
        The network to linearise (adapters applied; at the core point when there is a core).
    names : list of str
        The user-weight parameter names.
    x, y : inputs (N, ...) and labels (N,)
    num_classes : int
    core : Tensor (k,), int64
        Core positions: never held out.
    target_scale, solver, seed
        As :func:`forgettable_finetune`.
    grid : sequence of float
        The µ values tried.
    held_out : float, optional
        Share of the deletable samples held out instead of the rule above (at least 20 samples).
    n_held_out : int, optional
        The number held out instead (at least 1; :func:`compare_points`).

    Returns
    -------
    (µ, {"held_out": n, "errors": {str(µ): error}, "chosen": µ, "best": the least error, "chance": the
    chance error 1 − the majority-class rate of the whole training labels, "chance_interval": a majority
    predictor's 95 % range on n samples, "at_chance": the best error lies within it})
    """
    core_set = set(core.tolist())
    n_del = len(y) - len(core_set)
    if n_held_out is not None:
        n_val = int(n_held_out)
        if not 1 <= n_val < n_del:
            raise ValueError(f"n_held_out must lie in [1, {n_del}), got {n_val}")
    else:
        n_val = held_out_size(n_del) if held_out is None else int(round(held_out * n_del))
        if n_val < 20:
            raise ValueError(f"mu='auto' holds out {n_val} of the {n_del} deletable samples and needs at least 20 "
                             f"there; {n_del} deletable samples are too few: give mu")
    fit, val = held_out_split(len(y), seed, core, n_val)
    errors, st, xf = {}, None, x[fit]
    for mu in sorted(grid, reverse=True):
        if st is not None and st.primal is not None:
            # the primal's eigendecomposition serves every ridge: a solve per µ, no new rows or Gram
            lin, h = st.space(xf)
            w, _ = dataclasses.replace(st.primal, mu=mu).fit(lin, h, y[fit], torch.ones(len(fit), dtype=torch.bool))
            st.model.set_delta_flat(w)
        else:
            cfg = _solver_config(None, names, isinstance(x, ModelInputs), mu=mu, target_scale=target_scale,
                                 sigma=0.0, solver=SolverConfig(solver=solver))
            st = MLState(tangent_network(net, names), torch.zeros(0, dtype=torch.long), torch.arange(len(fit)),
                         torch.zeros(0, dtype=torch.long), cfg, num_classes, int(seed))
            st.space(xf)
            train_exact_factored(st, xf, y[fit], torch.Generator().manual_seed(7919 * int(seed) + 11))
        errors[mu] = 1.0 - accuracy(st.model, x[val], y[val])
    best = min(errors.values())
    chosen = max(mu for mu, e in errors.items() if e <= best + MU_TIE)
    report = chance_report(best, n_val, y, num_classes)
    return chosen, {"held_out": n_val, "errors": {f"{k:g}": v for k, v in errors.items()}, "chosen": chosen,
                    "best": best, "chance": report["chance"], "chance_interval": report["chance_interval"],
                    "majority": report["majority"], "at_chance": report["at_chance"]}


def near_chance(best: float, chance: float, n: int) -> bool:
    """True when a held-out error ``best`` on ``n`` samples lies within the 95 % range of a majority
    predictor's error around the ``chance`` error (:func:`scrubnet.mlforget.chance.at_chance`)."""
    return at_chance(best, chance, n)


def refuse_near_chance(search: dict, what: str = "mu='auto'") -> None:
    """``ValueError`` when a µ search's (or a fixed µ's) best held-out error is within the chance interval
    (:mod:`scrubnet.mlforget.chance`): the forgettable model is no better than predicting the majority class
    and a checkpoint would be useless."""
    if near_chance(search["best"], search["chance"], search["held_out"]):
        report = {"error": search["best"], "held_out": search["held_out"], "chance": search["chance"],
                  "majority": search.get("majority", "?"),
                  "chance_interval": list(chance_interval(search["chance"], search["held_out"]))}
        raise ValueError(refusal(report, f"{what}, the linearised engine near chance") +
                         "; a core that damaged the network is dropped only when the pretrained point is better")


def compare_points(at_core: tuple, at_pretrained: tuple, x: Inputs, y: Tensor, num_classes: int, core: Tensor,
                   mu, **opts) -> tuple[bool, dict, dict | None]:
    """Is the core point at least as good a point of linearisation as the pretrained one, on held-out data?

    The same seeded held-out share of the deletable samples (10 %, at least min(20, half)) scores both: with
    a µ, the forgettable model fitted exactly on the rest at that µ; with ``mu="auto"``, the best over the µ
    grid (:func:`select_mu` at each point). The core point is kept unless its error is larger.

    Parameters
    ----------
    at_core, at_pretrained : (network, user-weight names)
        The networks to linearise (adapters applied) at the core point and at the pretrained point.
    x, y : inputs (N, ...) and labels (N,)
    num_classes : int
    core : Tensor (k,), int64
        Core positions (never held out; still fitted on at both points).
    mu : float or "auto"
    **opts
        ``target_scale``, ``solver``, ``seed`` of :func:`select_mu`.

    Returns
    -------
    (keep the core point, {"core_error", "pretrained_error", "held_out", "mu"}, the core point's µ search when
    ``mu="auto"`` and it is kept, else the pretrained point's, else None)
    """
    n_del = len(y) - len(core)
    n_val = max(int(round(0.1 * n_del)), min(20, n_del // 2))
    auto = isinstance(mu, str)
    if n_val < 1:
        raise ValueError(f"the core check needs at least 2 deletable samples to hold one out, got {n_del}; give "
                         "fewer core_ids or check_core=False")
    kw = {} if auto else {"grid": (float(mu),), "n_held_out": n_val}
    found = [select_mu(*point, x, y, num_classes, core, **opts, **kw)[1] for point in (at_core, at_pretrained)]
    keep = found[0]["best"] <= found[1]["best"]
    check = {"core_error": found[0]["best"], "pretrained_error": found[1]["best"],
             "held_out": found[0]["held_out"], "mu": "auto" if auto else float(mu), "kept": bool(keep)}
    return keep, check, (found[0] if keep else found[1]) if auto else None


@torch.no_grad()
def predict(model: nn.Module, x: Inputs, chunk: int = 256) -> Tensor:
    """Logits (N, c) of ``model`` on ``x`` (tensor or ModelInputs), in chunks, no gradients."""
    return torch.cat([call_model(model, x[i:i + chunk]) for i in range(0, len(x), chunk)])


def accuracy(model: nn.Module, x, y: Tensor | None = None, chunk: int = 256) -> float:
    """Share of samples whose arg-max logit is the label (``x`` as in :func:`split_batch`)."""
    data_x, data_y = split_batch(x)
    y = data_y if y is None else y
    model.eval()
    return float((predict(model, data_x, chunk).argmax(1) == y).double().mean())


def ordinary_finetune(model: nn.Module, x, y: Tensor | None = None, *, user_weights: UserWeights = "head",
                      lr: float = 1e-3, epochs: int = 20, batch_size: int = 32, weight_decay: float = 0.0,
                      seed: int = 0) -> nn.Module:
    """The yardstick: the same user weights as :func:`forgettable_finetune`, fine-tuned the ordinary way.

    Parameters
    ----------
    model : nn.Module
        The pretrained network; copied, never modified.
    x, y
        As in :func:`forgettable_finetune`.
    user_weights : LoRA, list of str, or "head"
        The same subset (LoRA: B and the ``modules_to_save`` trained, A fixed, as in the forgettable model).
    lr, epochs, batch_size, weight_decay : Adam on the cross-entropy, reshuffled every epoch.
    seed : int

    Returns
    -------
    nn.Module
        The fine-tuned copy (non-linear), in eval mode. Trained in eval mode too (no dropout, BatchNorm
        running statistics), as the forgettable model is linearised.
    """
    data_x, data_y = split_batch(x)
    y = data_y if y is None else y
    _check_data(data_x, y, None)
    net, names, _ = user_weight_names(model, user_weights)
    net.eval()
    chosen = set(names)
    params = []
    for n, p in net.named_parameters():
        p.requires_grad_(n in chosen)
        if n in chosen:
            params.append(p)
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(int(seed))
    n = len(y)
    for _ in range(int(epochs)):
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(call_model(net, data_x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    for p in net.parameters():
        p.requires_grad_(False)
    return net.eval()


def deletion_account(state: MLState) -> dict:
    """The running account of a forgettable model: samples trained on, deleted so far, remaining, and the base
    model's hash (the weights that no deletion touches)."""
    return {"trained_on": int(len(state.user_ids)), "core": int(len(state.core_ids)),
            "deleted": int(len(state.forgotten_ids)),
            "remaining": int(len(state.remaining_ids())), "base_sha256": state.base_sha256,
            "user_weights": state.user_weights, "deleted_ids": np.asarray(state.forgotten_ids).tolist()}
