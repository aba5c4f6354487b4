"""``scrubnet tune`` on the user's own model files: the model from ``--model FILE.py:FACTORY`` and
``--weights``, the data from ``--data`` (an ``.npz`` with test arrays: the tuning measures test error and a
membership statistic), the user's training from ``--train FILE.py:FUNCTION`` (``train(model, data) -> model``,
called once on a fresh model from the factory — or ``--init`` weights — and the validation retain set as
``(x, y)`` tensors), the recipe from ``--recipe``. Writes the tuned profile (JSON) atomically.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scrubnet.data.splits import validate_forget_ids
from scrubnet.models.user import UserModelError, build_user_model, load_factory, load_user_weights, read_state_dict
from scrubnet.own_model import OwnModelError, _load_all, whole_class
from scrubnet.recipe import TrainingRecipe
from scrubnet.tuning.profile import DEFAULT_CANDIDATES, TunedProfile
from scrubnet.tuning.tune import tune


def load_train_function(spec: str):
    """The user's training function named by ``FILE.py:FUNCTION`` (or ``MODULE:FUNCTION``); imports (executes)
    the user's file, as ``--model`` does.

    Parameters
    ----------
    spec : str

    Returns
    -------
    callable
        ``train(model, data) -> model``.
    """
    try:
        return load_factory(spec)
    except UserModelError as e:
        raise OwnModelError(str(e).replace("--model", "--train")) from None


def tune_own(*, spec: str, options: dict[str, Any], weights: Path, data: Path, forget_ids: list[int],
             train_spec: str, recipe_path: Path | None, out: Path, init: Path | None = None, seed: int = 0,
             budget: int = 1, methods: tuple[str, ...] = DEFAULT_CANDIDATES, tolerance: float = 0.05,
             device: torch.device = torch.device("cpu"), draws: int = 3, engine=None, progress=None
             ) -> TunedProfile:
    """Tune on the user's model files and write the profile to ``out`` (module docstring).

    Parameters
    ----------
    spec, options, weights, data : str, dict, Path, Path
        The model factory, its options, its trained weights and the data file (with x_test/y_test).
    forget_ids : list of int
        A forget set like the requests the profile is for (positions in x_train): its size and class mix are
        copied, its samples never used.
    train_spec : str
        ``FILE.py:FUNCTION``: the user's training.
    recipe_path : Path, optional
        How the model was trained (TOML).
    out : Path
        Where the profile goes.
    init : Path, optional
        Weights the user's training starts from (default: a fresh model from the factory).
    seed, budget, methods, tolerance, draws, engine, progress
        As :func:`scrubnet.tuning.tune.tune`.
    device : torch.device

    Returns
    -------
    TunedProfile
    """
    recipe = TrainingRecipe.from_toml(recipe_path) if recipe_path is not None else TrainingRecipe()
    train = load_train_function(train_spec)
    model, _, ud, _ = _load_all(spec, options, weights, data, device)
    if ud.x_test is None or len(ud.y_test) == 0:
        raise OwnModelError(f"tuning measures test error and membership against held-out data: {data} has no "
                            "x_test/y_test")
    idx = validate_forget_ids(forget_ids, len(ud.y))
    start = build_user_model(spec, options).to(device)
    if init is not None:
        start = load_user_weights(start, read_state_dict(init), f"--init {init}")
    keep = torch.ones(len(ud.y), dtype=torch.bool)
    keep[idx] = False
    retain, forget_set = (ud.x[keep].to(device), ud.y[keep].to(device)), (ud.x[idx].to(device), ud.y[idx].to(device))
    prof = tune(model, retain, forget_set, train=train, test=(ud.x_test.to(device), ud.y_test.to(device)),
                recipe=recipe, init=start, forget_class=whole_class(ud.y, idx), seed=seed, methods=methods,
                budget=budget, tolerance=tolerance, draws=draws, engine=engine, progress=progress)
    prof.save(out)
    return prof
