"""scrubnet: make a trained network forget a cohort of its training data, and measure what is left.

The one call for a user's own model is :func:`scrubnet.forget` with a :class:`scrubnet.TrainingRecipe`."""
__version__ = "0.1.0"

from scrubnet.api import ForgetResult, ScrubFailed, forget  # noqa: E402
from scrubnet.data.stream import BatchKeys  # noqa: E402
from scrubnet.models.call import ModelInputs  # noqa: E402
from scrubnet.methods.base import ForgetContext  # noqa: E402
from scrubnet.recipe import TrainingRecipe  # noqa: E402
from scrubnet.methods.cost import CostEstimate, estimate  # noqa: E402  (the public cost model)

__all__ = ["BatchKeys", "CostEstimate", "ForgetContext", "ForgetResult", "ModelInputs", "ScrubFailed", "TrainingRecipe", "estimate", "forget"]
