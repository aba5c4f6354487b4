"""Scrubbing methods, one module each, behind :class:`scrubnet.methods.base.ForgettingMethod`."""
from scrubnet.methods.base import (ForgetContext, ForgettingMethod, ScrubResult, WeightGaussian, as_tensors,
                                   available_methods, get_method, method_class, protocol_method, register)

__all__ = ["ForgetContext", "ForgettingMethod", "ScrubResult", "WeightGaussian", "as_tensors", "available_methods",
           "get_method", "method_class", "protocol_method", "register"]
