"""A user's own forgetting method, named ``module:Class`` on the command line, registered like the built-ins.

``Class`` must subclass :class:`~scrubnet.methods.base.ForgettingMethod` and implement ``scrub``; it is
registered under its ``name`` class attribute when it sets one, else under ``module:Class`` itself (so the
name says where the code lives). ``module`` is imported with :func:`importlib.import_module`: it must be on
``sys.path`` (e.g. ``PYTHONPATH=.``) of every process that runs the method (Ray workers included).
"""
from __future__ import annotations

import importlib
import inspect

from scrubnet.methods.base import ForgettingMethod, method_class, register


def load_user_method(spec: str) -> str:
    """Import ``module:Class``, check it, register it (once) and return the name it is registered under."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"--method {spec!r}: expected module:Class (e.g. mymethods:MyScrub)")
    mod_name, cls_name = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--method {spec!r}: cannot import module {mod_name!r} ({e})") from None
    cls = getattr(mod, cls_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, ForgettingMethod)):
        raise ValueError(f"--method {spec!r}: {cls_name!r} is not a ForgettingMethod subclass in {mod_name!r}")
    if inspect.isabstract(cls):
        raise ValueError(f"--method {spec!r}: {cls_name} does not implement scrub()")
    name = cls.__dict__.get("name") or spec
    if method_class(name) is not cls:
        register(name)(cls)
    return name
