"""Build-on-first-use of the C++ kernels in ``csrc/``, cached across processes and runs.

Compiling against the torch that is already imported (instead of at ``pip install`` time in
an isolated build env) is what guarantees that pip never fetches a second torch and that the
binary matches the running ABI. The build is keyed by source hash, flags and SIMD level, so a
cache shared between heterogeneous machines never serves a binary built for another CPU, and
by the torch version and the install (the resolved ``csrc/`` path and the Python prefix), so two
checkouts or venvs on one machine each keep their own build instead of rebuilding each other's:
torch's ninja file names the sources' and headers' absolute paths, so one build directory shared
by two installs is recompiled whenever the other one loads it. If there is no compiler (or the
build fails) callers get ``None`` after a one-line warning and use the eager fallbacks.

A build prints one line on stderr when it starts and one when it ends, with the time it took
(loading a build from the cache prints nothing). The processes of a job that all need the
kernels build them once: the others wait, saying for whom. A lock left by a build that was
killed is removed with one line instead of being waited on forever (`build_lock`).

The cache holds shared libraries that this process loads and runs, so a cache directory that
someone else can write to is a way to run their code in every training job: a directory
(``TORCH_EXTENSIONS_DIR`` or the default under ``~/.cache``) owned by another user, or writable
by the group or by everyone, is refused with `UnsafeCacheError` instead of being used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Mapping, Optional

import torch

from lightning_npu.ops import build_lock

SOURCES = ("bindings.cpp", "gelu.cpp", "dropout.cpp", "norm.cpp", "softmax.cpp", "swiglu.cpp")
DISABLE_ENV = "LIGHTNING_NPU_NO_EXT"  # set to 1 to force the eager fallbacks
_lock = threading.Lock()
_state: dict[str, object] = {}


def csrc_dir(env: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """``csrc/`` of a source/editable checkout, or a copy shipped as package data."""
    env = os.environ if env is None else env
    here = Path(__file__).resolve()
    candidates = [env.get("LIGHTNING_NPU_CSRC"), here.parents[2] / "csrc", here.parents[1] / "_csrc"]
    for cand in candidates:
        if cand and (Path(cand) / "bindings.cpp").is_file():
            return Path(cand)
    return None


def cache_dir(env: Optional[Mapping[str, str]] = None) -> Path:
    env = os.environ if env is None else env
    root = env.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lightning_npu", "ops"
    )
    return Path(root)


class UnsafeCacheError(PermissionError):
    """The extension cache directory could be written by someone else; its binaries are not loaded."""


def check_private_dir(path: Path) -> None:
    """Refuse `path` unless it is a directory of this user that neither the group nor others can write.

    Its parents must not be world-writable either (anyone could swap the directory for their own), unless
    they have the sticky bit, like ``/tmp``, which lets only an entry's owner rename it.
    """
    uid = os.geteuid()
    fix_env = "point TORCH_EXTENSIONS_DIR at a private directory (e.g. ~/.cache/lightning_npu/ops)"
    current = path.resolve()
    for i, d in enumerate([current, *current.parents]):
        try:
            st = d.stat()
        except OSError as err:
            raise UnsafeCacheError(f"C++ extension cache {path}: cannot check {d} ({err}); {fix_env}.") from err
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if i == 0:
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeCacheError(f"C++ extension cache {d} is not a directory; {fix_env}.")
            if st.st_uid != uid:
                raise UnsafeCacheError(
                    f"C++ extension cache {d} is owned by uid {st.st_uid}, not by this user (uid {uid}): its "
                    f"binaries could be anyone's code. Use a directory you own: {fix_env}."
                )
            if writable:
                raise UnsafeCacheError(
                    f"C++ extension cache {d} is writable by its group or by everyone "
                    f"(mode {stat.S_IMODE(st.st_mode):o}): anyone could plant a binary there. "
                    f"Run `chmod go-w {d}`, or {fix_env}."
                )
        elif st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafeCacheError(
                f"C++ extension cache {path}: its parent {d} is writable by everyone without the sticky bit (mode "
                f"{stat.S_IMODE(st.st_mode):o}), so anyone could replace the cache; {fix_env}."
            )


def _private_cache(path: Path) -> Path:
    """Create `path` (mode 0700) if missing, then `check_private_dir` it."""
    if not path.exists():
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
    check_private_dir(path)
    return path


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


@dataclass(frozen=True)
class BuildSpec:
    """One build of the kernels: what it compiles, with which flags, and where it lives in the cache."""

    name: str  # lightning_npu_ops_<simd>_<key>: the module name and the build directory's name
    build_dir: Path
    src: Path
    cflags: tuple[str, ...]
    simd: str

    @property
    def library(self) -> Path:
        """The shared library a finished build leaves (what `load` imports)."""
        return self.build_dir / f"{self.name}{'.pyd' if os.name == 'nt' else '.so'}"

    @property
    def built(self) -> bool:
        """The library exists and is newer than every source (else loading it runs the compiler again)."""
        try:
            made = self.library.stat().st_mtime
            return all((self.src / n).stat().st_mtime <= made for n in (*SOURCES, "common.h"))
        except OSError:
            return False


def build_key(src: Path, cflags: list[str] | tuple[str, ...]) -> str:
    """The cache key: the sources, the flags, the torch version and the install (resolved csrc/ path, Python
    prefix)."""
    digest = hashlib.sha1()
    for name in (*SOURCES, "common.h"):
        digest.update((src / name).read_bytes())
    digest.update(" ".join(cflags).encode())
    digest.update(torch.__version__.encode())
    digest.update(f"\0{src.resolve()}\0{os.path.realpath(sys.prefix)}".encode())
    return digest.hexdigest()[:10]


def build_spec(env: Optional[Mapping[str, str]] = None) -> BuildSpec:
    """The build that `load` would use here (`env`: the environment, default os.environ); computes names only
    (nothing is created or compiled)."""
    src = csrc_dir(env)
    if src is None:
        raise RuntimeError("csrc/ not found next to the package (set LIGHTNING_NPU_CSRC)")
    simd, flags = _simd_flags()
    cflags = ("-O3", "-fopenmp", "-fno-math-errno", *flags)
    name = f"lightning_npu_ops_{simd}_{build_key(src, cflags)}"
    return BuildSpec(name=name, build_dir=cache_dir(env) / name, src=src, cflags=cflags, simd=simd)


def _say(message: str) -> None:
    """One line on stderr, where a job's log shows it next to Lightning's."""
    print(f"lightning_npu: {message}", file=sys.stderr, flush=True)


def _compile(spec: BuildSpec) -> ModuleType:
    """torch's JIT build of `spec` (a no-op when its library is up to date), then the import of the library."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=spec.name,
        sources=[str(spec.src / s) for s in SOURCES],
        extra_cflags=list(spec.cflags),
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(spec.src)],
        build_directory=str(spec.build_dir),
        verbose=bool(os.environ.get("LIGHTNING_NPU_VERBOSE_BUILD")),
    )


def _build(hint: bool = True) -> ModuleType:
    cache = _private_cache(cache_dir())  # first: an unsafe cache is refused even where nothing can be built
    spec = build_spec()
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    _private_cache(cache / spec.name)
    with build_lock.held(spec.build_dir, _say):  # waits for a live build, removes a dead one's lock
        fresh = not spec.built  # decided after waiting: the build waited on may have made it
        if fresh:
            _say(f"building the fused C++ kernels ({spec.simd}) in {spec.build_dir}; this takes a few minutes, once "
                 "per install" + (" (`lightning-npu build-ops` builds them ahead of time)" if hint else ""))
        start = time.monotonic()
        try:
            module = _compile(spec)
        except BaseException as err:
            if fresh:
                _say(f"building the fused C++ kernels failed after {time.monotonic() - start:.0f} s "
                     f"({type(err).__name__})")
            raise
        if fresh:
            _say(f"built the fused C++ kernels in {time.monotonic() - start:.0f} s: {spec.library}")
        return module


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
            except UnsafeCacheError:
                raise  # not a missing compiler: the user must fix the directory, a silent fallback would hide it
            except Exception as err:  # compiler missing, headers missing, build error
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                _state["error"] = first
                warnings.warn(
                    f"lightning_npu: fused C++ ops unavailable ({first}); using eager fallbacks.", stacklevel=2
                )
        _state["module"] = module
        return module


def build() -> Path:
    """Build the kernels now (or load them from the cache) and return the library's path; raises what stopped the
    build (`lightning-npu build-ops`). Unlike `load`, nothing is silently replaced by the eager fallbacks."""
    with _lock:
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            raise RuntimeError(f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]} (unset it to build)")
        if _state.get("module") is None:
            _state["module"] = _build(hint=False)  # already ahead of time: no hint to run build-ops
            _state.pop("error", None)
        return build_spec().library


@dataclass(frozen=True)
class Status:
    """What `load` would find here (`status`)."""

    spec: Optional[BuildSpec]  # None: no csrc/ to build from
    loaded: bool  # this process has imported the kernels
    built: bool  # an up-to-date build for this torch, CPU, sources and install is in the cache
    problem: Optional[str]  # why no build can run here (disabled, no csrc/, no compiler); None: one can
    error: Optional[str]  # why a build in this process failed
    lock: build_lock.LockState  # a build in progress, or a dead build's lock that the next build removes
    others: tuple[str, ...]  # the cache's other builds: other torch versions, sources, flags or installs


def status(env: Optional[Mapping[str, str]] = None) -> Status:
    """Whether the kernels are built for this torch, CPU, sources and install, and whether they could be built,
    found without building, creating or importing anything (`lightning-npu doctor`). Raises `UnsafeCacheError`
    for a cache directory that others can write to, as `load` does."""
    env = os.environ if env is None else env
    cache = cache_dir(env)
    if cache.exists():
        check_private_dir(cache)
    problem = f"disabled by {DISABLE_ENV}={env[DISABLE_ENV]}" if env.get(DISABLE_ENV, "") not in ("", "0") else None
    cxx = env.get("CXX", "c++")
    if problem is None and shutil.which(cxx, path=env.get("PATH")) is None:
        problem = f"no C++ compiler ({cxx!r} not on PATH)"
    try:
        spec: Optional[BuildSpec] = build_spec(env)
    except RuntimeError as err:
        spec, problem = None, problem or str(err)
    others = tuple(sorted(
        d.name for d in (cache.glob("lightning_npu_ops_*") if cache.is_dir() else ())
        if (spec is None or d.name != spec.name) and (d / f"{d.name}.so").is_file()
    ))
    has_dir = spec is not None and spec.build_dir.is_dir()
    return Status(
        spec=spec,
        loaded=_state.get("module") is not None,
        built=spec is not None and spec.built,
        problem=problem,
        error=_state.get("error"),  # type: ignore[arg-type]
        lock=build_lock.inspect(spec.build_dir) if has_dir else build_lock.LockState(),
        others=others,
    )


def available() -> bool:
    return load() is not None


def load_error() -> Optional[str]:
    load()
    return _state.get("error")  # type: ignore[return-value]
