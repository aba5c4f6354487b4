"""Scrubbing methods, one module each, behind :class:`scrubnet.methods.base.ForgettingMethod` (the interface,
the registry, the option rules, :func:`~scrubnet.methods.base.estimate` and the context builders)."""
from scrubnet.methods.base import (ForgetContext, ForgettingMethod, Option, ScrubResult, WeightGaussian, anchor_method,
                                   as_tensors, available_methods, costed_methods, estimate, get_method, method_class,
                                   methods_with, protocol_context, protocol_method, register)

__all__ = ["ForgetContext", "ForgettingMethod", "Option", "ScrubResult", "WeightGaussian", "anchor_method",
           "as_tensors", "available_methods", "costed_methods", "estimate", "get_method", "method_class",
           "methods_with", "protocol_context", "protocol_method", "register"]
