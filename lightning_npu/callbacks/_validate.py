"""Constructor-argument checks shared by the callbacks.

A callback is built long before it runs: a wrong type found at `__init__` costs a traceback that names
the argument, the value and the fix; found at step 10 000 it costs the run. ``bool`` is a subclass of
``int`` in Python, so every integer check refuses ``True``/``False`` explicitly.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): must be True or False.")
    return value


def check_int(owner: str, name: str, value: Any, minimum: int, example: int, allow_none: bool = False) -> Optional[int]:
    """An int >= `minimum` (or None when `allow_none`); a bool or a float is a TypeError, not a silent cast."""
    if value is None and allow_none:
        return None
    none = ", or None" if allow_none else ""
    if not _is_int(value):
        raise TypeError(f"{owner}({name}={value!r}): must be an integer >= {minimum}{none}, e.g. {name}={example}.")
    if value < minimum:
        raise ValueError(f"{owner}({name}={value!r}): must be an integer >= {minimum}{none}, e.g. {name}={example}.")
    return value


def check_fraction(owner: str, name: str, value: Any, example: float) -> float:
    """A real number in (0, 1]; a string such as "0.5" is refused rather than compared with a float later."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}({name}={value!r}): must be a number in (0, 1], e.g. {name}={example}.")
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{owner}({name}={value!r}): must be a number in (0, 1], e.g. {name}={example}.")
    return float(value)


def check_path(owner: str, name: str, value: Any) -> Optional[str]:
    """None, a str or an os.PathLike; anything else (an int, a list) is refused here, not at the first save."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        raise TypeError(f"{owner}({name}={value!r}): must be a directory path (str or pathlib.Path), or None.")
    return os.fspath(value)


def check_numbers(owner: str, name: str, value: Any, example: str) -> tuple:
    """A list or tuple of real numbers (a str is a sequence too, but never what was meant)."""
    numbers = isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    )
    if not numbers:
        raise TypeError(f"{owner}({name}={value!r}): must be a tuple or list of numbers, e.g. {name}={example}.")
    return tuple(value)
