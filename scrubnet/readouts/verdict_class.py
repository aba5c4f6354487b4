"""The probe of a whole-class verdict: do the scrubbed model's features still *carry* the class, though its
outputs no longer give it?

A fresh linear classifier (multinomial logistic regression on standardised features, classes weighted to
balance) is fitted on the features of D_r (a seeded sample) and of held-out data at the model's last hidden
layer, cross-fitted over the held-out examples (``folds`` stratified folds), and read on the class's held-out
examples: ``recall`` = the fraction of them it assigns to the class. The same probe runs on the input model's
features (``recall_before``), on the scrubbed model's (``recall_after``) and, where one is at hand, on a model
that never saw the class (``recall_never``). Because the probe is fitted anew on each model's features, any
re-parametrisation of the layer (a permutation of its units, a per-unit scale, a new head fitted on those
features) leaves it unchanged: a model that only suppresses the class's logit keeps the features, the probe
recovers the class as before and the verdict is ``hidden``.

The layer: by default the input of the last ``nn.Linear`` called whose output has the logits' shape (the head,
also when other operations follow it: a wrapper lowering one logit, a bias added after it), found by forward
hooks; or the output of a module the user names (``layer="backbone.pool"``), flattened. A model where neither
is found cannot be probed (``None``): the class's verdict is then undecided, never ``forgot``.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.device import model_device
from scrubnet.models.call import call_model

#: D_r examples whose features the probe is fitted on (a seeded sample)
PROBE_RETAIN = 2000


def _to(x, device):
    # a tensor or ModelInputs (the main input with extras such as an attention mask) moves itself; a dict by key
    return {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)


def _features_of_chunk(model: nn.Module, x, layer: str | None) -> torch.Tensor | None:
    """Features (n, d) of one chunk at ``layer`` (a module's dotted name: its output) or, by default, at the
    input of the last ``nn.Linear`` whose output has the logits' shape; None when no such layer exists."""
    seen = []
    if layer is not None:
        mods = dict(model.named_modules())
        if layer not in mods:
            raise ValueError(f"the model has no module named {layer!r} to probe")
        hooks = [mods[layer].register_forward_hook(lambda mod, inp, out: seen.append(out))]
    else:
        hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((inp[0], out)))
                 for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        logits = call_model(model, x)
    finally:
        for h in hooks:
            h.remove()
    if layer is not None:
        out = seen[-1] if seen else None
        out = out[0] if isinstance(out, (tuple, list)) else out
        return None if not torch.is_tensor(out) or out.shape[0] != logits.shape[0] else out.reshape(len(out), -1)
    for inp, out in reversed(seen):
        if torch.is_tensor(out) and out.shape == logits.shape:
            return inp.reshape(len(inp), -1)
    return None


@torch.no_grad()
def layer_features(model: nn.Module, data, layer: str | None = None, max_examples: int | None = None,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """Features (n, d) float64 and labels (n,) of ``data`` at the probed layer (eval mode; the model's mode is
    restored), at most ``max_examples`` (a seeded subset of indexable data); None when no layer is found."""
    chunks = as_stream(data).sample_chunks(max_examples, seed)
    was, device = model.training, model_device(model)
    model.eval()
    feats, labels, seen = [], [], 0
    try:
        for x, y in chunks:
            if max_examples is not None and seen >= max_examples:
                break
            f = _features_of_chunk(model, _to(x, device), layer)
            if f is None:
                return None
            feats.append(f.double().cpu().numpy())
            labels.append(y.cpu().numpy())
            seen += len(y)
    finally:
        model.train(was)
    if not feats:
        return None
    k = max_examples
    return np.concatenate(feats)[:k], np.concatenate(labels).astype(np.int64)[:k]


def fitted_recall(retain: tuple[np.ndarray, np.ndarray], heldout: tuple[np.ndarray, np.ndarray], label: int,
                  folds: int = 5, seed: int = 0) -> float:
    """Cross-fitted recall of class ``label`` by a linear probe on features.

    Each fold of the held-out examples (stratified) is predicted by a multinomial logistic regression
    (standardised features, L2 with C = 1, classes weighted to balance) fitted on D_r's features and the other
    folds; recall = the fraction of the class's held-out examples predicted as the class.

    Parameters
    ----------
    retain, heldout : (features (n, d), labels (n,))
    label : int
    folds : int
        Folds of the held-out data (at most the class's held-out count, at least 2).
    seed : int

    Returns
    -------
    float in [0, 1]
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    (xr, yr), (xh, yh) = retain, heldout
    n_c = int((yh == label).sum())
    if n_c < 2:
        raise ValueError("the probe needs at least two held-out examples of the class")
    # a label with fewer held-out examples than folds cannot be stratified: such labels stay in every fit
    counts = {c: int((yh == c).sum()) for c in np.unique(yh)}
    k = max(2, min(folds, n_c))
    strat = np.array([c if counts[c] >= k else -1 for c in yh])
    split = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(xh, strat)
    hit = 0
    for tr, te in split:
        te = te[yh[te] == label]
        if not len(te):
            continue
        clf = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, class_weight="balanced", max_iter=300))
        clf.fit(np.concatenate([xr, xh[tr]]), np.concatenate([yr, yh[tr]]))
        hit += int((clf.predict(xh[te]) == label).sum())
    return hit / n_c


def class_probe(model_before: nn.Module, model_after: nn.Module, heldout, label: int, retain=None, *,
                never_saw: nn.Module | None = None, layer: str | None = None, max_retain: int = PROBE_RETAIN,
                seed: int = 0) -> dict | None:
    """Recall of class ``label`` on its held-out examples by a linear probe fitted on each model's features.

    Parameters
    ----------
    model_before, model_after : nn.Module
        The input and the scrubbed model.
    heldout : (x, y) tensors, Dataset, DataLoader or DataStream
        Held-out data (every label: the probe is fitted on them, cross-fitted).
    label : int
        The forgotten class.
    retain : data, optional
        D_r: at most ``max_retain`` of its examples (seeded) join the probe's fit (without it, held-out only).
    never_saw : nn.Module, optional
        A model that never saw the class (e.g. trained on D_r): its probe recall is the floor of "forgotten".
    layer : str, optional
        The dotted name of the scrubbed model's module whose output is probed (default: the head's input,
        found by hooks); the input and never-saw models use their module of that name if they have one, else
        their head's input.
    max_retain, seed : int

    Returns
    -------
    dict or None
        ``recall_before``, ``recall_after``, ``recall_never`` (None without ``never_saw``), ``recall_model``
        (the input model's own recall), ``chance`` (1 / classes), ``n`` (the class's held-out examples),
        ``layer`` (what was probed); None when a model has no layer to probe or too few examples of the class.
    """
    hs = as_stream(heldout)
    n_c = int(sum(int((y == label).sum()) for _, y in hs.chunks()))
    if n_c < 2:
        return None
    recalls = {}
    classes = model_hit = 0
    for name, m in (("before", model_before), ("after", model_after), ("never", never_saw)):
        if m is None:
            recalls[name] = None
            continue
        # the named layer is the scrubbed model's; the input (or never-saw) model uses it when it has a module
        # of that name, else its own head's input (a model of another shape names its layers otherwise)
        lay = layer if name == "after" or layer in dict(m.named_modules()) else None
        h = layer_features(m, hs, lay)
        r = None if retain is None else layer_features(m, retain, lay, max_retain, seed)
        if h is None or (retain is not None and r is None):
            return None
        r = r if r is not None else (np.zeros((0, h[0].shape[1])), np.zeros(0, dtype=np.int64))
        recalls[name] = fitted_recall(r, h, label, seed=seed)
    with torch.no_grad():
        was = model_before.training
        model_before.eval()
        try:
            for x, y in hs.chunks():
                logits = call_model(model_before, _to(x, model_device(model_before)))
                classes = logits.shape[-1]
                keep = y.to(logits.device) == label
                model_hit += int((logits.argmax(-1)[keep] == label).sum())
        finally:
            model_before.train(was)
    return {"recall_before": recalls["before"], "recall_after": recalls["after"], "recall_never": recalls["never"],
            "recall_model": model_hit / n_c, "chance": 1.0 / max(classes, 1), "n": n_c,
            "layer": layer or "input of the head (last linear layer giving the logits' shape)"}
