"""Building configuration dataclasses from plain dicts (TOML, JSON sidecars) with clear errors."""
from __future__ import annotations

from dataclasses import fields


def strict_from_dict(cls, d: dict, what: str):
    """``cls(**d)``, refusing keys that are not fields of the dataclass ``cls`` (naming them)."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {what} option(s): {', '.join(unknown)}")
    return cls(**d)
