"""Where and when a benchmark ran: the metadata every JSON under `benchmarks/results` carries.

A number without its date, commit, CPU and machine load cannot be compared with a later one or reproduced, and a
timing taken on a shared, loaded machine must say so. `metadata` collects those facts; `write_json` is the one way a
benchmark writes its result (it stamps ``payload["environment"]``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> Optional[list[float]]:
    """The 1, 5 and 15 minute load averages (runnable processes, the whole machine), None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def metadata() -> dict[str, Any]:
    """Date (UTC), commit (and whether the tree had uncommitted changes), CPU, threads, load and versions."""
    import lightning as L
    import torch

    from lightning_npu import device as dev

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15min": load_average(),
        "accelerator": dev.accelerator_type(),  # the best device here; a benchmark may have run on the CPU anyway
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def describe(meta: dict[str, Any]) -> str:
    """One line for a report: ``2026-12-01T10:00:00+00:00, commit 1a2b3c4 (+ changes), Intel Xeon, 2 CPUs ...``."""
    commit = (meta.get("commit") or "unknown")[:10] + (" + uncommitted changes" if meta.get("dirty") else "")
    load = meta.get("load_average_1_5_15min")
    load_s = "/".join(f"{x:g}" for x in load) if load else "n/a"
    return (f"{meta['date']}, commit {commit}, {meta['cpu_model']} ({meta['cpu_count']} CPUs, "
            f"{meta['torch_threads']} torch threads), load average {load_s} (1/5/15 min), torch {meta['torch']}, "
            f"lightning {meta['lightning']}")


def write_json(path: str | Path, payload: dict[str, Any], indent: int = 2) -> Path:
    """Write `payload` with ``environment`` = `metadata()` (keys the benchmark set itself win)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "environment": {**metadata(), **payload.get("environment", {})}}
    path.write_text(json.dumps(payload, indent=indent) + "\n")
    return path
