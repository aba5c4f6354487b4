"""Linearisation readiness: is a network past its early transient, so that linearising it (LQF, the NTK
scrub, ML-Forgetting) is reasonable? A **heuristic**, not a theorem (docs/decisions/critical-periods.md, "Critical periods").

Two readouts:

* :func:`fisher_readiness` — from the Fisher-trace curve of a run: the peak, where it was, and whether the
  curve is past it and has come down: ready ⇔ the peak lies at least ``patience`` evaluations before the last
  one and the last value is at most (1 − ``min_drop``)·peak. The critical-periods chapter observes that the
  trace rises during the transient (when the regularisers matter) and then decays, and that linearised
  dynamics describe training after it.
* :func:`linearization_gap` — how far the network is from its linearisation around an anchor w_a, on held-out
  data: f_lin(x) = f_{w_a}(x) + J_{w_a}(x)(w_b − w_a) against the network f_{w_b}(x) reached by training on:

      relative gap = ‖f_lin − f_{w_b}‖_F / ‖f_{w_b} − f_{w_a}‖_F     (logits over the held-out set),
      agreement    = fraction of held-out inputs where f_lin and f_{w_b} predict the same class.

  Both networks are evaluated in eval mode; the linearisation keeps w_a's BatchNorm statistics (a
  linearisation in the weights cannot move them). f_{w_b} uses its own statistics (the gap then includes
  their drift), or, with ``anchor_statistics=True``, w_a's (the gap of the weights alone).
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from scrubnet.models import eval_mode
from scrubnet.models.linearized import LinearizedModel


def fisher_readiness(times: list[int], traces: list[float], *, patience: int = 3, min_drop: float = 0.2) -> dict:
    """{"peak", "peak_at", "final", "final_over_peak", "past_peak", "decayed", "ready"} from a trace curve
    measured at ``times`` (module docstring)."""
    if len(times) != len(traces) or not traces:
        raise ValueError("need one Fisher trace per time, at least one")
    if not 0 <= min_drop < 1:
        raise ValueError(f"min_drop must be in [0, 1), got {min_drop}")
    i_peak = max(range(len(traces)), key=lambda i: traces[i])
    peak, final = float(traces[i_peak]), float(traces[-1])
    ratio = final / peak if peak > 0 else float("nan")
    past = len(traces) - 1 - i_peak >= patience
    decayed = bool(peak > 0 and final <= (1 - min_drop) * peak)
    return {"peak": peak, "peak_at": int(times[i_peak]), "final": final, "final_over_peak": ratio,
            "past_peak": past, "decayed": decayed, "ready": past and decayed}


@torch.no_grad()
def linearization_gap(anchor: nn.Module, trained: nn.Module, x: Tensor, batch_size: int = 512, *,
                      anchor_statistics: bool = False) -> dict:
    """{"relative_gap", "agreement", "move"}: the network ``trained`` (w_b) against the linearisation of
    ``anchor`` (w_a, same architecture) evaluated at w_b, on held-out inputs ``x`` (module docstring);
    "move" = ‖f_{w_b} − f_{w_a}‖_F / √N, the logit change the linearisation has to explain.
    ``anchor_statistics``: evaluate f_{w_b} with w_a's buffers (BatchNorm running statistics)."""
    lin = LinearizedModel(anchor)
    if anchor_statistics:
        trained = copy.deepcopy(trained)
        buffers = dict(anchor.named_buffers())
        for name, b in trained.named_buffers():
            b.copy_(buffers[name])
    wb = dict(trained.named_parameters())
    tangent = {n: (wb[n].detach() - p.detach()) for n, p in lin.base.named_parameters()
               if n in lin.linearized_names}
    num = den = 0.0
    agree = 0
    with eval_mode(trained):
        for i in range(0, len(x), batch_size):
            xb = x[i:i + batch_size]
            fa, jv = lin.output_and_jvp(xb, tangent)
            fb = trained(xb)
            f_lin = fa + jv
            num += float((f_lin - fb).double().pow(2).sum())
            den += float((fb - fa).double().pow(2).sum())
            agree += int((f_lin.argmax(1) == fb.argmax(1)).sum())
    return {"relative_gap": (num / den) ** 0.5 if den > 0 else float("nan"), "agreement": agree / len(x),
            "move": (den / len(x)) ** 0.5}
