"""Argument checks shared by the strategy's layout, the callbacks and the planner.

An argument is given long before it is used: a wrong type found at construction costs a traceback that
names the argument, the value and the fix; found at step 10 000 it costs the run. Each check returns the
value (normalised where said), so a constructor reads ``self.x = check_int("x", x, ...)``.

One message shape everywhere. With an `owner` (a callback's class name)::

    GradientHealthGuard(loss_spike_factor='10'): must be a number > 1, or None, e.g. loss_spike_factor=10.0.

without one (the strategy's layout, the planner)::

    `tensor_parallel_size=0` must be a positive integer, e.g. `tensor_parallel_size=2`.

`error` is the exception class to raise (``ParallelConfigError``, ``PlannerError``); by default a wrong type
is a ``TypeError`` and a value out of range a ``ValueError``. ``bool`` is a subclass of ``int`` in Python,
so the number checks refuse ``True``/``False`` explicitly, and a string such as ``"0.5"`` is refused rather
than compared with a float later. This module imports nothing from the project, so any module can use it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Optional


def message(name: str, value: Any, must: str, example: Any = None, owner: Optional[str] = None) -> str:
    """The one message shape (see the module doc); `example` is shown as ``name=example``."""
    if owner:
        eg = f", e.g. {name}={example}" if example is not None else ""
        return f"{owner}({name}={value!r}): must be {must}{eg}."
    eg = f", e.g. `{name}={example}`" if example is not None else ""
    return f"`{name}={value!r}` must be {must}{eg}."


def _raise(kind: type, error: Optional[type], text: str) -> None:
    raise (error or kind)(text)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_bool(name: str, value: Any, *, owner: Optional[str] = None, error: Optional[type] = None) -> bool:
    """True or False; ``1``, ``"yes"`` and None are refused (a string is always truthy)."""
    if not isinstance(value, bool):
        _raise(TypeError, error, message(name, value, "True or False", True, owner))
    return value


def check_int(name: str, value: Any, *, minimum: int = 1, example: Any = None, allow_none: bool = False,
              owner: Optional[str] = None, error: Optional[type] = None) -> Optional[int]:
    """An int >= `minimum` (or None when `allow_none`); a bool or a float is refused, not silently cast."""
    if value is None and allow_none:
        return None
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    must = what + (", or None" if allow_none else "")
    example = max(minimum, 2) if example is None else example
    if not is_int(value):
        _raise(TypeError, error, message(name, value, must, example, owner))
    if value < minimum:
        _raise(ValueError, error, message(name, value, must, example, owner))
    return value


def check_number(name: str, value: Any, *, above: Optional[float] = None, at_least: Optional[float] = None,
                 below: Optional[float] = None, at_most: Optional[float] = None, example: Any = None,
                 allow_none: bool = False, integral: bool = False, what: Optional[str] = None,
                 owner: Optional[str] = None, error: Optional[type] = None) -> Optional[float]:
    """A finite real number within the given bounds (or None when `allow_none`); returned as a float.

    `integral` also asks for a whole value (``8.0`` passes, ``8.5`` does not), as the planner's sizes do.
    `what` replaces the phrase the bounds make ("a positive number") when a unit says more.
    """
    if value is None and allow_none:
        return None
    must = what or _number_phrase(above, at_least, below, at_most, integral) + (", or None" if allow_none else "")
    if not is_number(value):
        _raise(TypeError, error, message(name, value, must, example, owner))
    ok = math.isfinite(value) and (not integral or float(value).is_integer())
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    ok = ok and (below is None or value < below) and (at_most is None or value <= at_most)
    if not ok:
        _raise(ValueError, error, message(name, value, must, example, owner))
    return float(value)


def _number_phrase(above: Any, at_least: Any, below: Any, at_most: Any, integral: bool) -> str:
    noun = "integer" if integral else "number"
    if above == 0 and at_least is None and below is None and at_most is None:
        return f"a positive {noun}"
    low = f"({above:g}" if above is not None else f"[{at_least:g}" if at_least is not None else ""
    high = f"{below:g})" if below is not None else f"{at_most:g}]" if at_most is not None else ""
    if low and high:
        return f"a {noun} in {low}, {high}"
    bounds = [f"{op} {b:g}" for op, b in ((">", above), (">=", at_least), ("<", below), ("<=", at_most))
              if b is not None]
    return f"a {noun} {bounds[0]}" if bounds else f"a finite {noun}"


def check_fraction(name: str, value: Any, *, example: Any = None, allow_none: bool = False,
                   owner: Optional[str] = None, error: Optional[type] = None) -> Optional[float]:
    """A real number in (0, 1]."""
    return check_number(name, value, above=0.0, at_most=1.0, example=example, allow_none=allow_none,
                        owner=owner, error=error)


def check_choice(name: str, value: Any, choices: Iterable[Any], *, owner: Optional[str] = None,
                 error: Optional[type] = None) -> Any:
    """One of `choices`; ``True`` is not ``1`` here, nor ``1.0``."""
    choices = tuple(choices)
    if not any(value == c and isinstance(value, bool) == isinstance(c, bool)
               and isinstance(value, float) == isinstance(c, float) for c in choices):
        if owner:
            text = f"{owner}({name}={value!r}): choose one of {', '.join(map(repr, choices))}."
        else:
            text = f"`{name}={value!r}` is unknown; choose one of {list(choices)}."
        _raise(ValueError, error, text)
    return value


def check_str(name: str, value: Any, *, example: Any, allow_none: bool = False, owner: Optional[str] = None,
              error: Optional[type] = None) -> Optional[str]:
    """A non-empty string (a metric name, an address, an id)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value:
        must = "a non-empty string" + (", or None" if allow_none else "")
        _raise(TypeError, error, message(name, value, must, example, owner))
    return value


def check_path(name: str, value: Any, *, allow_none: bool = True, owner: Optional[str] = None,
               error: Optional[type] = None) -> Optional[str]:
    """None, a str or an os.PathLike; anything else (an int, a list) is refused here, not at the first save."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        must = "a directory path (str or pathlib.Path)" + (", or None" if allow_none else "")
        _raise(TypeError, error, message(name, value, must, "'checkpoints/'", owner))
    return os.fspath(value)


def check_numbers(name: str, value: Any, *, example: Any, owner: Optional[str] = None,
                  error: Optional[type] = None) -> tuple:
    """A list or tuple of real numbers (a str is a sequence too, but never what was meant)."""
    if not (isinstance(value, (list, tuple)) and all(is_number(v) for v in value)):
        _raise(TypeError, error, message(name, value, "a tuple or list of numbers", example, owner))
    return tuple(value)


def check_writable_dir(name: str, value: Any, *, owner: Optional[str] = None,
                       error: Optional[type] = None) -> Path:
    """Create directory `value` if it is missing and check that this process may write there.

    Called at setup, so that a checkpoint directory nobody can write is found when the run starts, not when
    the first save (or the preemption notice) comes.
    """
    path = Path(value)
    who = f"{owner}({name}={os.fspath(value)!r})" if owner else f"`{name}={os.fspath(value)!r}`"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a parent is a file, a read-only file system, no permission
        _raise(type(err), error, f"{who}: cannot create this directory ({err.strerror or err}); give a directory "
                                 f"this process can write, e.g. {name}='checkpoints/'.")
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        _raise(PermissionError, error, f"{who}: this process cannot write in this directory; give one it can "
                                       f"write, e.g. {name}='checkpoints/'.")
    return path
