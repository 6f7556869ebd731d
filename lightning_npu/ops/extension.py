"""Build-on-first-use of the C++ kernels in ``csrc/``, cached across processes and runs.

Compiling against the torch that is already imported (instead of at ``pip install`` time in
an isolated build env) is what guarantees that pip never fetches a second torch and that the
binary matches the running ABI. The build is keyed by source hash, flags and SIMD level, so a
cache shared between heterogeneous machines never serves a binary built for another CPU. If
there is no compiler (or the build fails) callers get ``None`` after a one-line warning and
use the eager fallbacks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

SOURCES = ("bindings.cpp", "gelu.cpp", "dropout.cpp", "norm.cpp", "softmax.cpp", "swiglu.cpp")
DISABLE_ENV = "LIGHTNING_NPU_NO_EXT"  # set to 1 to force the eager fallbacks
_lock = threading.Lock()
_state: dict[str, object] = {}


def csrc_dir() -> Optional[Path]:
    """``csrc/`` of a source/editable checkout, or a copy shipped as package data."""
    here = Path(__file__).resolve()
    candidates = [os.environ.get("LIGHTNING_NPU_CSRC"), here.parents[2] / "csrc", here.parents[1] / "_csrc"]
    for cand in candidates:
        if cand and (Path(cand) / "bindings.cpp").is_file():
            return Path(cand)
    return None


def cache_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lightning_npu", "ops"
    )
    return Path(root)


def _simd_flags() -> tuple[str, list[str]]:
    """Compile for the SIMD level ATen itself dispatches to on this CPU (not blindly -march=native)."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "DEFAULT"
    if cap in ("AVX512", "AVX512_BF16", "AMX") or cap.startswith("AVX512"):
        return "avx512", ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]
    if cap == "AVX2":
        return "avx2", ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return "default", []


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    src = csrc_dir()
    if src is None:
        raise RuntimeError("csrc/ not found next to the package (set LIGHTNING_NPU_CSRC)")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    simd, flags = _simd_flags()
    cflags = ["-O3", "-fopenmp", "-fno-math-errno", *flags]
    digest = hashlib.sha1()
    for name in (*SOURCES, "common.h"):
        digest.update((src / name).read_bytes())
    digest.update(" ".join(cflags).encode())
    digest.update(torch.__version__.encode())
    name = f"lightning_npu_ops_{simd}_{digest.hexdigest()[:10]}"
    build_dir = cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(src / s) for s in SOURCES],
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(src)],
        build_directory=str(build_dir),
        verbose=bool(os.environ.get("LIGHTNING_NPU_VERBOSE_BUILD")),
    )


def load() -> Optional[ModuleType]:
    """The compiled kernels module, or None (after one warning) when it cannot be built."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module: Optional[ModuleType] = None
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            _state["error"] = f"disabled by {DISABLE_ENV}"
        else:
            try:
                module = _build()
            except Exception as err:  # compiler missing, headers missing, build error
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                _state["error"] = first
                warnings.warn(
                    f"lightning_npu: fused C++ ops unavailable ({first}); using eager fallbacks.", stacklevel=2
                )
        _state["module"] = module
        return module


def available() -> bool:
    return load() is not None


def load_error() -> Optional[str]:
    load()
    return _state.get("error")  # type: ignore[return-value]
