"""Sample ids (positions in D) from text: the one parser behind every ``--forget-ids``/``--ids`` option.

Two formats: integers separated by whitespace or commas (``#`` starts a comment), or a JSON list of
integers. JSON numbers that are not integers (``3.5``, ``1e400``), booleans and strings are refused rather
than converted — ``int(3.5)`` would silently forget sample 3.
"""
from __future__ import annotations

import json

#: ids are stored as int64
_ID_MAX = 2 ** 63 - 1


class IdsFormatError(ValueError):
    """Text that is not a list of integer sample ids."""


def parse_sample_ids(text: str, source: str = "ids") -> list[int]:
    """The integers of ``text`` (format in the module docstring), in order; ``source`` names the input in
    the error message. Range, duplicates and emptiness are checked later, against the data."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            vals = json.loads(stripped, parse_constant=lambda c: c)  # NaN/Infinity stay strings: refused below
        except json.JSONDecodeError as e:
            raise IdsFormatError(f"{source} is not a valid JSON list: {e}") from None
        if not isinstance(vals, list):
            raise IdsFormatError(f"{source} must be a JSON list of integers")
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, int):
                raise IdsFormatError(f"{source}: {json.dumps(v) if not isinstance(v, str) else repr(v)} is not "
                                     "an integer sample id (JSON ids must be integers such as 7, not 7.0, \"7\" "
                                     "or true)")
    else:
        vals = []
        for line in text.splitlines():
            for tok in line.split("#", 1)[0].replace(",", " ").split():
                if not tok.lstrip("+-").isdigit():
                    raise IdsFormatError(f"{source}: {tok!r} is not an integer sample id")
                vals.append(int(tok))
    for v in vals:
        if abs(v) > _ID_MAX:
            raise IdsFormatError(f"{source}: {v} is not a valid sample id (out of the int64 range)")
    return vals
