"""The probe of a whole-class verdict: does the scrubbed model still *carry* the class in its penultimate
features, though its outputs no longer give it?

The probe is the input model's own head (the linear layer whose output is the model's logits) applied to the
scrubbed model's penultimate features of the class's held-out examples. A model that only suppresses the
class's logit (its head row re-initialised, a bias pushed down) keeps the features, and the input model's
head reads the class off them as before: ``hidden``. A model that never saw the class (or one whose features
were rebuilt) gives that head nothing to read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scrubnet.data.stream import as_stream
from scrubnet.device import model_device
from scrubnet.models.call import call_model


def _head_call(model: nn.Module, x) -> tuple[nn.Linear | None, torch.Tensor | None, torch.Tensor]:
    """(head, its input, logits): the last ``nn.Linear`` called whose output *is* the model's logits, or
    (None, None, logits) when no such layer exists (a head followed by other operations, an ensemble)."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0], out)))
             for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        logits = call_model(model, x)
    finally:
        for h in hooks:
            h.remove()
    for mod, inp, out in reversed(seen):
        if out.shape == logits.shape and torch.equal(out, logits):
            return mod, inp, logits
    return None, None, logits


def _to(x, device):
    # a tensor or ModelInputs (the main input with extras such as an attention mask) moves itself; a dict by key
    return {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)


@torch.no_grad()
def class_probe(model_before: nn.Module, model_after: nn.Module, heldout, label: int) -> dict | None:
    """Recall of class ``label`` on its held-out examples by the input model (``recall_before``) and by the
    input model's head on the scrubbed model's penultimate features (``recall_probe``).

    Parameters
    ----------
    model_before, model_after : nn.Module
        The input and the scrubbed model.
    heldout : (x, y) tensors, Dataset, DataLoader or DataStream
        Held-out data; only the examples of ``label`` are used.
    label : int
        The forgotten class.

    Returns
    -------
    dict or None
        ``recall_before``, ``recall_probe``, ``n``, ``chance`` (1 / classes); None when either model has no
        single linear head or the two heads' inputs differ in size (the probe is then not defined).
    """
    modes = [(m, m.training) for m in (model_before, model_after)]
    hit_b = hit_p = n = classes = 0
    try:
        for m, _ in modes:
            m.eval()
        for x, y in as_stream(heldout).chunks():
            keep = y == label
            if not keep.any():
                continue
            x = {k: v[keep] for k, v in x.items()} if isinstance(x, dict) else x[keep]
            head_b, _, logits_b = _head_call(model_before, _to(x, model_device(model_before)))
            head_a, feat_a, _ = _head_call(model_after, _to(x, model_device(model_after)))
            if head_b is None or head_a is None or head_b.in_features != feat_a.shape[-1]:
                return None
            probe = F.linear(feat_a.to(head_b.weight.device), head_b.weight, head_b.bias)
            hit_b += int((logits_b.argmax(-1) == label).sum())
            hit_p += int((probe.argmax(-1) == label).sum())
            n, classes = n + int(keep.sum()), logits_b.shape[-1]
    finally:
        for m, was in modes:
            m.train(was)
    return None if n == 0 else {"recall_before": hit_b / n, "recall_probe": hit_p / n, "n": n, "chance": 1 / classes}

