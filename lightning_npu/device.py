"""The one place that knows about device types.

Every other module asks this one for the device type, its count, its collective backend,
memory numbers, synchronisation and RNG state, so that the same strategy code serves Ascend
NPUs, CUDA GPUs and CPUs. ``torch_npu`` is imported lazily: importing it registers the
``npu`` device with PyTorch, and it must not be a hard dependency of a CPU install. "Lazily"
means *this package* never imports it at module level; since torch 2.5, ``import torch`` itself
loads an installed torch_npu through the ``torch.backends`` entry point unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` is set, in which case the first NPU request here imports it.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch
import torch.distributed as dist

NPU = "npu"
CPU = "cpu"
_TORCH_NPU_HINT = (
    "Ascend NPU support needs the `torch_npu` package that matches your torch version and CANN toolkit: "
    "`pip install torch-npu==<your torch version>` (see https://gitee.com/ascend/pytorch), then source "
    "the CANN `set_env.sh`. To run on another device pass `accelerator='cpu'` or `accelerator='cuda'`."
)


class NPUUnavailableError(RuntimeError):
    """Raised when an NPU is requested but `torch_npu` or a device is missing."""


def import_torch_npu() -> Any:
    """Import `torch_npu` on demand (it registers the `npu` device type with PyTorch)."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        raise NPUUnavailableError(f"`torch_npu` is not installed. {_TORCH_NPU_HINT}") from err
    except Exception as err:  # noqa: BLE001 - torch_npu raises RuntimeError (CUDA torch) or bare Exception (CANN)
        raise NPUUnavailableError(
            f"`torch_npu` is installed but failed to import ({type(err).__name__}: {err}). It needs a CPU build of "
            f"the exact torch version it was built for and a sourced CANN toolkit. {_TORCH_NPU_HINT}"
        ) from err


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def npu_available() -> bool:
    if not torch_npu_installed():
        return False
    try:
        import_torch_npu()
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:
        return False


def npu_device_count() -> int:
    return int(torch.npu.device_count()) if npu_available() else 0  # type: ignore[attr-defined]


def accelerator_type() -> str:
    """The device type of the machine's accelerator, or "cpu" when there is none."""
    if torch_npu_installed():
        import_torch_npu()
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else CPU


def device_type_of(device: torch.device | str) -> str:
    return torch.device(device).type


def device_count(device_type: str) -> int:
    if device_type == CPU:
        return 1
    if device_type == NPU:
        import_torch_npu()
    return int(torch.get_device_module(device_type).device_count())


def is_available(device_type: str) -> bool:
    if device_type == CPU:
        return True
    if device_type == NPU:
        return npu_available()
    try:
        return bool(torch.get_device_module(device_type).is_available())
    except (AttributeError, RuntimeError):
        return False


def comm_backend(device_type: str) -> str:
    """Collective backend for a device type: npu->hccl, cuda->nccl, cpu->gloo."""
    if device_type == NPU:
        import_torch_npu()  # torch_npu registers "hccl" in default_device_backend_map
        return dist.Backend.default_device_backend_map.get(NPU, "hccl")
    try:
        return dist.Backend.default_device_backend_map[device_type]
    except KeyError:
        raise ValueError(
            f"No collective backend is known for device type {device_type!r}; "
            f"pass `process_group_backend=...` to NPUHybridStrategy explicitly."
        ) from None


def group_options(device_type: str, buffer_mb: float) -> Any:
    """Process-group options for an extra communicator that carries one gradient bucket at a time (None: defaults).

    On NPU, every HCCL communicator allocates its own buffers of ``HCCL_BUFFSIZE`` MB (default 200); torch_npu's
    ``ProcessGroupHCCL.Options.hccl_config["hccl_buffer_size"]`` sizes them per group, so the hierarchy's groups get a
    buffer of one bucket instead of another 200 MB each. Other devices keep their backend's defaults.
    """
    if device_type != NPU:
        return None
    torch_npu = import_torch_npu()
    options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    options.hccl_config = {"hccl_buffer_size": max(1, int(-(-buffer_mb // 1)))}
    return options


def set_device(device: torch.device) -> None:
    if device.type != CPU:
        torch.get_device_module(device.type).set_device(device)


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type != CPU:
        torch.get_device_module(device.type).synchronize(device)


def side_stream(device: torch.device | str) -> Any:
    """A new stream on `device` for work that overlaps the current stream (host-to-device copies), or None where
    the device has no streams (CPU): callers then run the work inline."""
    device = torch.device(device)
    if device.type == CPU:
        return None
    module = torch.get_device_module(device.type)
    return module.Stream(device=device) if hasattr(module, "Stream") else None


def stream_context(stream: Any) -> Any:
    """Make `stream` current (a context manager); a null context for None."""
    import contextlib

    if stream is None:
        return contextlib.nullcontext()
    return torch.get_device_module(stream.device.type).stream(stream)


def current_stream(device: torch.device | str) -> Any:
    """The device's current stream, or None on CPU."""
    device = torch.device(device)
    if device.type == CPU:
        return None
    return torch.get_device_module(device.type).current_stream(device)


def empty_cache(device_type: str) -> None:
    if device_type != CPU:
        torch.get_device_module(device_type).empty_cache()


def reset_peak_memory(device_type: str) -> None:
    """Start a new peak (``max_allocated_bytes``) on an accelerator; CPU has no allocator peak to reset."""
    if device_type != CPU:
        torch.get_device_module(device_type).reset_peak_memory_stats()


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """Allocator numbers for an accelerator, or this process's RSS on CPU (bytes)."""
    device = torch.device(device)
    if device.type == CPU:
        return {"rss_bytes": float(current_rss_bytes()), "peak_rss_bytes": float(peak_rss_bytes())}
    mod = torch.get_device_module(device.type)
    stats = {
        "allocated_bytes": float(mod.memory_allocated(device)),
        "reserved_bytes": float(mod.memory_reserved(device)),
        "max_allocated_bytes": float(mod.max_memory_allocated(device)),
    }
    if hasattr(mod, "mem_get_info"):
        free, total = mod.mem_get_info(device)
        stats.update(free_bytes=float(free), total_bytes=float(total))
    return stats


# Options for long runs, where fragmentation grows: segments that grow in place instead of new blocks of odd
# sizes, and freeing cached blocks before the allocator would fail. Both the CUDA and the torch_npu allocator take them.
ALLOCATOR_DEFAULTS = "expandable_segments:True,garbage_collection_threshold:0.8"


def allocator_env_var(device_type: str) -> str | None:
    """The variable a device's caching allocator reads its options from (None: the CPU has no caching allocator)."""
    return None if device_type == CPU else f"PYTORCH_{device_type.upper()}_ALLOC_CONF"


def configure_allocator(device_type: str) -> str | None:
    """Set `ALLOCATOR_DEFAULTS` unless the user set the allocator's options, or it already allocated (too late: the
    options are read once). Returns what was set."""
    var = allocator_env_var(device_type)
    if var is None or os.environ.get(var) or os.environ.get("PYTORCH_ALLOC_CONF"):
        return None
    module = getattr(torch, device_type, None)
    if module is not None and getattr(module, "is_initialized", lambda: False)():
        return None
    os.environ[var] = ALLOCATOR_DEFAULTS
    return ALLOCATOR_DEFAULTS


def free_memory_bytes(device: torch.device | str) -> float:
    """Memory this device can still give: the allocator's free bytes, or on CPU the machine's MemAvailable (shared by
    every local process: divide it among them)."""
    stats = memory_stats(device)
    if "free_bytes" in stats:
        return stats["free_bytes"]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def manual_seed_all(seed: int, device_type: str) -> None:
    torch.manual_seed(seed)
    if device_type != CPU:
        torch.get_device_module(device_type).manual_seed_all(seed)


def rng_state(device_type: str) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device_type != CPU:
        state[device_type] = torch.get_device_module(device_type).get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    for device_type, value in state.items():
        if device_type == CPU:
            torch.set_rng_state(value)
        else:
            torch.get_device_module(device_type).set_rng_state(value)


def autocast_device_type(device: torch.device | str) -> str:
    """Autocast takes the plain device type string (never hard-code it at call sites)."""
    return torch.device(device).type


@functools.cache
def fast_bf16(device_type: str) -> bool:
    """Whether bf16 GEMMs run natively: a CPU without AVX512-BF16/AMX (as oneDNN reports) falls back to a scalar
    bf16 kernel, about 30x slower than fp32 GEMM (measured on an AVX2 AMD EPYC); accelerators have bf16 units."""
    if device_type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bf16 path either
        return False
