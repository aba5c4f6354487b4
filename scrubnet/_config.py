"""Building configuration dataclasses from plain dicts (TOML, JSON sidecars) with clear errors.

Every value is checked against the field's annotation before the dataclass is built: ``int`` fields take
integers only (not ``true``, not ``3.0``), ``float`` fields take finite numbers (an integer is converted;
NaN and inf are refused), ``str``/``bool``/``dict`` their own type, ``list[X]`` a list of X, ``X | None``
also nothing. A ``ranges`` mapping adds bounds (``"> 0"``, ``">= 1"``, ``"[0, 1)"``). The message names the
key as it is written in the TOML file (``train.lr``) and the expected type or range, for instance
``configuration key train.lr: expected a finite number > 0, got 'fast'``.
"""
from __future__ import annotations

import math
import os
import types
import typing
from dataclasses import fields, is_dataclass


class ConfigValueError(ValueError):
    """A configuration value of the wrong type or out of range."""


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a) for a in args) + " (or nothing)" if len(args) < len(typing.get_args(tp)) \
            else " or ".join(_describe(a) for a in args)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s" if args else "a list"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
            dict: "a table (dict)"}.get(tp, getattr(tp, "__name__", str(tp)))


def _check_type(value, tp):
    """``value`` converted to ``tp`` (int → float only) or ``ValueError`` with no message."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for a in typing.get_args(tp):
            if a is type(None):
                continue
            try:
                return _check_type(value, a)
            except ValueError:
                pass
        raise ValueError
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError
        args = typing.get_args(tp)
        inner = args[0] if args else typing.Any
        out = [_check_type(v, inner) for v in value]
        return tuple(out) if origin is tuple else out
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError
        return value
    return value  # nested dataclasses and anything else: their own constructor checks them


def _in_range(value, spec: str) -> bool:
    spec = spec.strip()
    if spec.startswith(("[", "(")):
        lo, hi = (float(t) for t in spec[1:-1].split(","))
        return (value >= lo if spec[0] == "[" else value > lo) and (value <= hi if spec[-1] == "]" else value < hi)
    op, num = spec.split()
    bound = float(num)
    return {">": value > bound, ">=": value >= bound, "<": value < bound, "<=": value <= bound}[op]


def check_value(key: str, value, tp, range_spec: str | None = None):
    """``value`` checked against the annotation ``tp`` and ``range_spec``; :class:`ConfigValueError` naming
    ``key`` otherwise. Returns the (int → float converted) value."""
    expected = _describe(tp) + ((f" in {range_spec}" if range_spec[0] in "[(" else f" {range_spec}")
                                if range_spec else "")
    try:
        out = _check_type(value, tp)
    except ValueError:
        raise ConfigValueError(f"configuration key {key}: expected {expected}, got {value!r}") from None
    if range_spec is not None and out is not None:
        items = out if isinstance(out, (list, tuple)) else [out]
        if not all(_in_range(v, range_spec) for v in items):
            raise ConfigValueError(f"configuration key {key}: expected {expected}, got {value!r}")
    return out


def check_table_keys(cls, d, what: str, prefix: str = "") -> None:
    """Refuse a ``d`` that is not a dict, or that has keys which are not fields of the dataclass ``cls``
    (naming them with their table ``prefix``)."""
    if not isinstance(d, dict):
        raise ConfigValueError(f"configuration key {prefix.rstrip('.') or what}: expected a table (dict), got {d!r}")
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown {what} option(s): {', '.join(prefix + u for u in unknown)}")


def strict_from_dict(cls, d: dict, what: str, prefix: str = "", ranges: dict[str, str] | None = None):
    """``cls(**d)``, refusing keys that are not fields of the dataclass ``cls`` (naming them) and values
    of the wrong type or out of ``ranges`` (module docstring). ``prefix`` is the keys' table in the TOML
    file (``"train."``)."""
    check_table_keys(cls, d, what, prefix)
    hints = typing.get_type_hints(cls)
    ranges = ranges or {}
    checked = {}
    for k, v in d.items():
        tp = hints[k]
        if is_dataclass(tp) and isinstance(v, dict):
            checked[k] = v
            continue
        checked[k] = check_value(prefix + k, v, tp, ranges.get(k))
    return cls(**checked)


#: environment variable that shrinks every command's default sizes (the README test runs the README with it)
TINY_ENV = "SCRUBNET_TINY"


def tiny_mode() -> bool:
    """Whether ``SCRUBNET_TINY=1`` asks for the tiny configuration: the experiment, the MixDP protocol, the
    audit pool, ``scrubnet mlforget train`` and the critical-periods study then default to sizes that run in seconds (values given in a
    TOML file or on the command line still win). For tests and smoke runs; the numbers mean nothing."""
    return os.environ.get(TINY_ENV, "").strip() not in ("", "0")


def under_defaults(defaults: dict, d: dict) -> dict:
    """``d`` with ``defaults`` filled in where ``d`` has no value (tables merged recursively)."""
    out = dict(defaults)
    for k, v in d.items():
        out[k] = under_defaults(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
