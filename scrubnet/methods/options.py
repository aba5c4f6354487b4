"""The rule of one method option: what :class:`~scrubnet.methods.base.ForgettingMethod` checks before a method
is built (re-exported by :mod:`scrubnet.methods.base`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scrubnet._config import ConfigValueError, check_value


@dataclass(frozen=True)
class Option:
    """The rule of one method option (scikit-learn style parameter constraints), checked before the method
    is built (:meth:`ForgettingMethod.check_options`).

    Parameters
    ----------
    type : type
        The annotation the value must fit, as in configuration files: ``int``, ``float`` (an int is
        converted; NaN/inf refused), ``str``, ``bool``, ``X | None`` …
    range : str, optional
        Bounds, e.g. ``"> 0"``, ``">= 1"``, ``"[0, 1)"`` (:func:`scrubnet._config.check_value`).
    choices : tuple, optional
        The allowed values (strings).
    default : Any
        The constructor's default, for the documentation and the CLI's help.
    """

    type: Any
    range: str | None = None
    choices: tuple | None = None
    default: Any = None

    def check(self, key: str, value):
        """``value`` converted (int → float) or ``ValueError`` naming ``key`` and what is expected."""
        try:
            out = check_value(key, value, self.type, self.range)
        except ConfigValueError as e:
            raise ValueError(str(e).replace("configuration key ", "option ", 1)) from None
        if self.choices is not None and out is not None and out not in self.choices:
            raise ValueError(f"option {key}: expected one of {', '.join(repr(c) for c in self.choices)}, "
                             f"got {value!r}")
        return out
