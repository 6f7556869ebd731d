"""What `gradient_compression` means: the parsed spec per mode or per module glob, validated before any process
group exists (`ParallelConfig` reads it; `compression.Compressor` acts on it)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_npu.parallel.errors import CompressionConfigError

MODES = ("bf16", "int8", "topk", "onebit", "powersgd")


@dataclass(frozen=True)
class CompressionSpec:
    mode: str
    ratio: float = 0.1  # topk: the fraction of values sent
    warmup_steps: int = 0  # steps reduced uncompressed first (onebit: 1-bit Adam's warm-up)
    rank: int = 1  # powersgd: the rank of the approximation
    error_feedback: bool = True
    frozen_variance: bool = False  # 1-bit Adam: compress Adam's momentum, freeze its variance after the warm-up


def parse_compression(value: Any) -> Union[None, CompressionSpec, dict[str, Optional[CompressionSpec]]]:
    """``None``, a mode name, ``{"mode": ..., options}``, or ``{module glob: mode or options or None}``."""
    if value is None:
        return None
    if isinstance(value, str):
        return _spec({"mode": value})
    if isinstance(value, dict) and "mode" in value:
        return _spec(value)
    if isinstance(value, dict) and value:
        return {str(glob): _glob_value(str(glob), v) for glob, v in value.items()}
    raise CompressionConfigError(
        f"`gradient_compression={value!r}` must be None, a mode name ({', '.join(MODES)}), "
        "{'mode': ..., 'ratio': ..., 'warmup_steps': ..., 'rank': ..., 'error_feedback': ..., 'frozen_variance': ...} or "
        "{module glob: mode}.")


def _glob_value(glob: str, value: Any) -> Optional[CompressionSpec]:
    if value is None:
        return None
    if not (isinstance(value, str) or (isinstance(value, dict) and "mode" in value)):
        raise CompressionConfigError(
            f"`gradient_compression[{glob!r}]={value!r}` must be None (uncompressed), a mode name ({', '.join(MODES)}) "
            "or an options dict with a 'mode'.")
    try:
        return _spec({"mode": value} if isinstance(value, str) else value)
    except (CompressionConfigError, TypeError) as err:
        raise CompressionConfigError(f"`gradient_compression[{glob!r}]`: {err}") from None


def _spec(options: dict) -> CompressionSpec:
    unknown = set(options) - set(CompressionSpec.__dataclass_fields__)
    if unknown:
        raise CompressionConfigError(
            f"`gradient_compression` has unknown options {sorted(unknown)}; use {sorted(CompressionSpec.__dataclass_fields__)}.")
    spec = CompressionSpec(**options)
    if spec.mode not in MODES:
        raise CompressionConfigError(f"`gradient_compression` mode {spec.mode!r} is unknown; choose one of {list(MODES)}.")
    if isinstance(spec.ratio, bool) or not isinstance(spec.ratio, (int, float)) or not 0 < spec.ratio <= 1:
        raise CompressionConfigError(f"`gradient_compression` ratio={spec.ratio!r} must be in (0, 1], e.g. 0.1 (10%).")
    if isinstance(spec.warmup_steps, bool) or not isinstance(spec.warmup_steps, int) or spec.warmup_steps < 0:
        raise CompressionConfigError(
            f"`gradient_compression` warmup_steps={spec.warmup_steps!r} must be an int >= 0 (steps sent uncompressed).")
    if isinstance(spec.rank, bool) or not isinstance(spec.rank, int) or spec.rank < 1:
        raise CompressionConfigError(f"`gradient_compression` rank={spec.rank!r} must be a positive int, e.g. 1.")
    if not isinstance(spec.error_feedback, bool):
        raise CompressionConfigError(f"`gradient_compression` error_feedback={spec.error_feedback!r} must be True or False.")
    if not isinstance(spec.frozen_variance, bool):
        raise CompressionConfigError(
            f"`gradient_compression` frozen_variance={spec.frozen_variance!r} must be True or False.")
    if spec.frozen_variance and (spec.mode == "bf16" or not spec.error_feedback or spec.warmup_steps < 1):
        raise CompressionConfigError(
            f"`gradient_compression` frozen_variance=True (1-bit Adam) with mode={spec.mode!r}, "
            f"error_feedback={spec.error_feedback}, warmup_steps={spec.warmup_steps}: it needs a lossy mode (int8, "
            "topk, onebit, powersgd) with error feedback and a dense warm-up of warmup_steps >= 1 steps, from which "
            "Adam's variance is frozen (e.g. warmup_steps=100).")
    return spec


def spec_for(parsed: Any, module_name: str, param_name: Optional[str] = None) -> Optional[CompressionSpec]:
    """The spec that applies to a parameter of module `module_name` (full name `param_name`): for a dict of globs,
    the first glob, in the dict's order, that matches the module name or the parameter's name (None: no glob)."""
    if not isinstance(parsed, dict):
        return parsed
    for glob, spec in parsed.items():
        if fnmatch.fnmatchcase(module_name, glob) or (param_name is not None and fnmatch.fnmatchcase(param_name, glob)):
            return spec
    return None


def _glob_of(parsed: dict, module_name: str, param_name: str) -> Optional[str]:
    for glob in parsed:
        if fnmatch.fnmatchcase(module_name, glob) or fnmatch.fnmatchcase(param_name, glob):
            return glob
    return None
