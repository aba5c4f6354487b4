"""Reference models for the forgetting verdict: trained once per model, reused for every deletion request.

Offline LiRA's difficulty calibration (Carlini et al. 2022; the offline, few-reference regime of Zarifzadeh
et al. 2024): an example's logit confidence under the model, minus its mean confidence under reference models
that never trained on it, separates "memorised" from "merely easy" far better than the raw confidence, so the
per-example membership tests decide a request of a few samples.

Design: ``pairs`` pairs of models, each pair trained on two complementary random halves of the training data.
Every training example is then OUT of exactly one model per pair (its offset averages ``pairs`` values); a
held-out example is OUT of all of them, and its offset averages one model per pair, picked by a seeded coin, so
that D_f's and the held-out data's offsets carry the same noise.
"""
from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load, save as st_save
from torch import nn

from scrubnet.atomic_io import atomic_write_bytes, atomic_write_text
from scrubnet.readouts.forgetting import per_example_statistics

#: the file a reference directory is described by (beside ``reference_<k>.safetensors`` and ``members.safetensors``)
INDEX = "references.json"


def reference_halves(n_train: int, pairs: int = 2, seed: int = 0) -> np.ndarray:
    """Membership masks, bool shape (2·pairs, n_train): rows 2p and 2p+1 are complementary random halves."""
    if n_train < 2 or pairs < 1:
        raise ValueError(f"reference models need n_train >= 2 and pairs >= 1, got {n_train}, {pairs}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(pairs):
        half = np.zeros(n_train, dtype=bool)
        half[rng.permutation(n_train)[: n_train // 2]] = True
        rows += [half, ~half]
    return np.stack(rows)


@dataclass
class ReferenceModels:
    """Reference models of one trained model and which training examples each saw.

    Parameters
    ----------
    models : list of nn.Module
        2·pairs models, rows of ``members`` in order.
    members : ndarray of bool, shape (len(models), n_train)
        ``members[k, i]``: model k trained on training example i (rows 2p, 2p+1 complementary).
    seconds : float
        What training them cost once (wall-clock seconds), amortised over every request.
    """

    models: list
    members: np.ndarray
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        m = np.asarray(self.members, dtype=bool)
        if m.ndim != 2 or m.shape[0] != len(self.models) or m.shape[0] % 2:
            raise ValueError("members must be (2·pairs, n_train) with one row per model")
        if not (m[0::2] ^ m[1::2]).all():
            raise ValueError("rows 2p and 2p+1 of members must be complementary halves")
        self.members = m

    def info(self) -> dict:
        """``models`` (how many) and ``seconds`` (their one-off training cost), as the verdict records them."""
        return {"models": len(self.models), "seconds": float(self.seconds)}

    def save(self, directory: str | Path, meta: dict | None = None) -> Path:
        """Write the references to ``directory`` (created): one safetensors file per model, the membership
        matrix as safetensors, and ``references.json`` (count, pairs, training size, cost in seconds, and
        ``meta``: e.g. the sha256 of the weights and data they belong to). Each file is written atomically,
        the index last, so a directory without its index is not a set of references."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for k, m in enumerate(self.models):
            state = {n: t.detach().cpu().contiguous() for n, t in m.state_dict().items()}
            atomic_write_bytes(d / f"reference_{k}.safetensors", st_save(state))
        atomic_write_bytes(d / "members.safetensors",
                           st_save({"members": torch.from_numpy(self.members.astype(np.uint8))}))
        info = {"format": "scrubnet-references-1", "models": len(self.models), "pairs": len(self.models) // 2,
                "n_train": int(self.members.shape[1]), "seconds": float(self.seconds),
                "meta": {**self.meta, **(meta or {})}}
        atomic_write_text(d / INDEX, json.dumps(info, indent=2))
        return d


    def offsets(self, data, ids=None, seed: int = 0, inside: bool = False) -> np.ndarray:
        """Mean logit confidence, shape (n,), of each example of ``data`` under the references that never
        trained on it: the training examples at positions ``ids``, or held-out data (``ids`` None: one model
        per pair, by a coin seeded with ``seed``); with ``inside``, under those that did (``ids`` required).

        Parameters
        ----------
        data : (x, y) tensors, Dataset, DataLoader or DataStream
            The examples, in the order of ``ids``.
        ids : sequence of int, optional
            Their positions in the training data; None for data no reference trained on.
        seed : int
            Seed of the coin that picks one model per pair for held-out data.
        inside : bool
            Average over the references that trained on each example instead (online LiRA's IN side).

        Returns
        -------
        ndarray, shape (n,)
        """
        phi = np.stack([per_example_statistics(m, data).score("confidence") for m in self.models])
        return out_mean(phi, self.out_mask(phi.shape[1], ids, seed, inside))

    def out_mask(self, n: int, ids=None, seed: int = 0, inside: bool = False) -> np.ndarray:
        """Which references count for each of ``n`` examples, bool (models, n): those that never trained on
        the training examples at ``ids`` (with ``inside``: those that did), or one per pair by a seeded coin
        for held-out data (``ids`` None)."""
        if ids is None and inside:
            raise ValueError("the references that trained on an example need its training position (ids)")
        if ids is None:
            pick = np.random.default_rng(seed).integers(0, 2, size=(len(self.models) // 2, n))
            out = np.zeros((len(self.models), n), dtype=bool)
            out[0::2], out[1::2] = pick == 0, pick == 1
            return out
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) != n or ids.min() < 0 or ids.max() >= self.members.shape[1]:
            raise ValueError("ids must give one training position per example, inside the training data")
        return self.members[:, ids] if inside else ~self.members[:, ids]

    def scales(self, data, ids=None, seed: int = 0, prior: float = 4.0,
               pooled: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """Each example's mean (n,) and spread (n,) of logit confidence under the references that never
        trained on it, and the pooled variance: the per-example variance shrunk toward the pooled one with
        ``prior`` pseudo-observations (online LiRA's per-example variance, kept stable with 2–8 values).
        Pass the held-out data's ``pooled`` variance when scoring D_f, so both sets are scaled alike."""
        phi = np.stack([per_example_statistics(m, data).score("confidence") for m in self.models])
        return out_scale(phi, self.out_mask(phi.shape[1], ids, seed), prior, pooled)


def out_mean(phi: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Mean over the references marked in ``out`` (models, n) of ``phi`` (models, n): shape (n,)."""
    return (phi * out).sum(0) / out.sum(0)


def out_scale(phi: np.ndarray, out: np.ndarray, prior: float = 4.0, pooled: float | None = None
              ) -> tuple[np.ndarray, np.ndarray, float]:
    """(mean (n,), spread (n,), pooled variance): per example, the references' variance s² over its k OUT
    values shrunk toward the pooled variance σ² (the mean of s², unless given) as (k−1)·s² + prior·σ²
    over (k−1) + prior — a scaled-inverse-χ² prior with ``prior`` degrees of freedom."""
    k = out.sum(0)
    mu = out_mean(phi, out)
    ss = ((phi - mu) ** 2 * out).sum(0)
    s2 = np.where(k > 1, ss / np.maximum(k - 1, 1), np.nan)
    pooled = float(np.nanmean(s2)) if pooled is None else float(pooled)
    var = (np.maximum(k - 1, 0) * np.nan_to_num(s2) + prior * pooled) / (np.maximum(k - 1, 0) + prior)
    return mu, np.sqrt(np.maximum(var, 1e-12)), pooled


def train_references(fit: Callable[[np.ndarray, int], nn.Module], n_train: int, pairs: int = 2,
                     seed: int = 0) -> ReferenceModels:
    """Train the reference models once: ``fit(indices, seed)`` trains a model like the target (same recipe)
    on the training examples at ``indices``.

    Parameters
    ----------
    fit : callable (ndarray of int, int) -> nn.Module
        Trains one reference model on the given training positions with the given seed.
    n_train : int
        Size of the training data.
    pairs : int
        Pairs of complementary halves (2 pairs = 4 models, the measured default).
    seed : int
        Seed of the halves and of the references' training.

    Returns
    -------
    ReferenceModels
        With ``seconds`` = the wall-clock cost of the training.
    """
    members = reference_halves(n_train, pairs, seed)
    t0 = time.perf_counter()
    models = [fit(np.flatnonzero(m), seed * 1000 + k) for k, m in enumerate(members)]
    return ReferenceModels(models, members, time.perf_counter() - t0)


def load_references(directory: str | Path, template: nn.Module) -> ReferenceModels:
    """Reference models written by :meth:`ReferenceModels.save`, each loaded into a copy of ``template`` (the
    model they are references of: same architecture). Only safetensors are read (nothing is unpickled); a
    missing or inconsistent file is a ``ValueError`` naming it."""
    d = Path(directory)
    try:
        info = json.loads((d / INDEX).read_text())
        if info.get("format") != "scrubnet-references-1":
            raise ValueError(f"{d / INDEX} is not a scrubnet reference index")
        members = st_load((d / "members.safetensors").read_bytes())["members"].numpy().astype(bool)
        models = []
        for k in range(int(info["models"])):
            m = copy.deepcopy(template)
            m.load_state_dict(st_load((d / f"reference_{k}.safetensors").read_bytes()))
            models.append(m.eval())
    except (OSError, KeyError, json.JSONDecodeError, RuntimeError) as e:
        raise ValueError(f"cannot read the reference models in {d}: {e}") from None
    return ReferenceModels(models, members, float(info.get("seconds", 0.0)), dict(info.get("meta", {})))
