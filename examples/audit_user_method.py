"""A user's own forgetting method for ``scrubnet audit --method audit_user_method:ShrinkHead`` (README,
"Per-example audits"): it halves the last layer's weights, a crude way to lower the model's confidence.

    PYTHONPATH=examples scrubnet audit --methods original,retrain --method audit_user_method:ShrinkHead \
        --pool 8 --eps-models 4 --out runs/audit-mine
"""
import copy

from scrubnet.methods.base import ForgettingMethod, ScrubResult


class ShrinkHead(ForgettingMethod):
    """Multiply the weights of the model's last parameterised layer by ``factor`` (default 0.5)."""

    needs_retain = False

    def __init__(self, factor: float = 0.5):
        self.factor = float(factor)

    def scrub(self, model, retain, forget, ctx):
        out = copy.deepcopy(model)
        weights = [p for name, p in out.named_parameters() if name.endswith("weight")]
        weights[-1].data.mul_(self.factor)
        return ScrubResult(model=out)
