"""scrubnet: make a trained network forget a cohort of its training data, and measure what is left.

The one call for a user's own model is :func:`scrubnet.forget` with a :class:`scrubnet.TrainingRecipe`."""
__version__ = "0.1.0"

from scrubnet.api import ForgetResult, ScrubFailed, forget  # noqa: E402
from scrubnet.data.stream import BatchKeys  # noqa: E402
from scrubnet.models.call import ModelInputs  # noqa: E402
from scrubnet.cost_guard import estimate  # noqa: E402  (the public cost model)
from scrubnet.methods.base import ForgetContext  # noqa: E402
from scrubnet.recipe import TrainingRecipe  # noqa: E402
from scrubnet.recipe.retrain import measure_retraining, retrain_like_user  # noqa: E402
from scrubnet.scrub import scrub_and_measure  # noqa: E402
from scrubnet.training.cost import CostEstimate  # noqa: E402

__all__ = ["BatchKeys", "CostEstimate", "ForgetContext", "ForgetResult", "ModelInputs", "ScrubFailed", "TrainingRecipe", "estimate",
           "forget", "measure_retraining", "retrain_like_user", "scrub_and_measure"]
