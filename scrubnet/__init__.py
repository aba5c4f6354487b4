"""scrubnet: make a trained network forget a cohort of its training data, and measure what is left."""
__version__ = "0.1.0"

from scrubnet.methods.cost import CostEstimate, estimate  # noqa: E402  (the public cost model)
