"""RFC 8785 (JSON Canonicalization Scheme) serialisation: the bytes every signature of the service covers.

JCS fixes what plain ``json.dumps(sort_keys=True)`` leaves open, so that any implementation (Node's
``JSON.stringify`` over sorted keys, ``jq`` with the exponent rule below, another language's JCS library)
produces the same bytes:

* object members sorted by their names as UTF-16 code units; no whitespace; UTF-8 output;
* strings: ``"`` and ``\\`` escaped, U+0000..U+001F as ``\\b \\t \\n \\f \\r`` or ``\\u00xx`` (lower-case hex),
  every other character written as itself (no ``\\u`` escapes for non-ASCII);
* numbers as ECMAScript's ``Number.prototype.toString``: the shortest digits that read back to the same
  IEEE-754 double, no ``.0`` on integral values (``1.0`` → ``1``, ``-0.0`` → ``0``), plain notation for
  10⁻⁶ ≤ |x| < 10²¹, otherwise ``d.ddde±x`` (``1e-7``, ``1.5e+21``: no leading zero in the exponent);
* NaN, ±inf and integers beyond ±2⁵³ (not exactly representable) are refused (``ValueError``).
"""
from __future__ import annotations

import math

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
MAX_SAFE_INTEGER = 2 ** 53


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def number(x) -> str:
    """ECMAScript's ``Number.prototype.toString`` of ``x`` (an int or a finite float), as RFC 8785 requires."""
    if isinstance(x, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(x, int):
        if abs(x) > MAX_SAFE_INTEGER:
            raise ValueError(f"integer {x} is beyond ±2^53: not exactly representable in canonical JSON")
        x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{x} has no JSON form")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    digits, exp = repr(abs(x)).lower(), 0  # repr: the shortest round-trip digits
    if "e" in digits:
        digits, e = digits.split("e")
        exp = int(e)
    if "." in digits:
        whole, frac = digits.split(".")
    else:
        whole, frac = digits, ""
    frac = frac.rstrip("0")
    mant = (whole + frac).lstrip("0")
    # value = 0.mant × 10^n  (ECMAScript's n: the position of the decimal point after the first digit)
    n = len(whole.lstrip("0")) + exp if whole.strip("0") else exp - (len(frac) - len(frac.lstrip("0")))
    mant = mant.rstrip("0") or "0"
    k = len(mant)
    if k <= n <= 21:
        return sign + mant + "0" * (n - k)
    if 0 < n <= 21:
        return sign + mant[:n] + "." + mant[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + mant
    e = n - 1
    body = mant[0] + ("." + mant[1:] if k > 1 else "")
    return sign + body + "e" + ("+" if e > 0 else "-") + str(abs(e))


def _encode(obj, out: list) -> None:
    if obj is None:
        out.append("null")
    elif obj is True:
        out.append("true")
    elif obj is False:
        out.append("false")
    elif isinstance(obj, (int, float)):
        out.append(number(obj))
    elif isinstance(obj, str):
        out.append(_string(obj))
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        for i, v in enumerate(obj):
            if i:
                out.append(",")
            _encode(v, out)
        out.append("]")
    elif isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise ValueError("canonical JSON objects need string keys")
        out.append("{")
        for i, k in enumerate(sorted(obj, key=lambda s: s.encode("utf-16-be"))):
            if i:
                out.append(",")
            out.append(_string(k))
            out.append(":")
            _encode(obj[k], out)
        out.append("}")
    else:
        raise ValueError(f"{type(obj).__name__} has no canonical JSON form")


def canonical(obj) -> bytes:
    """The RFC 8785 canonical JSON of ``obj`` (dicts, lists, strings, finite numbers, booleans, None), UTF-8.

    Parameters
    ----------
    obj : object
        A JSON value.

    Returns
    -------
    bytes
        Its canonical serialisation; ``ValueError`` for a value JSON cannot hold exactly.
    """
    out: list = []
    _encode(obj, out)
    return "".join(out).encode("utf-8")
