"""Scrubbing methods, one module each, behind :class:`scrubnet.methods.base.ForgettingMethod` (the interface,
the registry, the option rules and the context builders; a method's cost is priced by
:func:`scrubnet.cost_guard.estimate`)."""
from scrubnet.methods.base import (ForgetContext, ForgettingMethod, Option, ScrubResult, WeightGaussian, anchor_method,
                                   as_tensors, available_methods, costed_methods, get_method, method_class,
                                   methods_with, protocol_context, protocol_method, register)

__all__ = ["ForgetContext", "ForgettingMethod", "Option", "ScrubResult", "WeightGaussian", "anchor_method",
           "as_tensors", "available_methods", "costed_methods", "get_method", "method_class",
           "methods_with", "protocol_context", "protocol_method", "register"]
