"""Complete-or-absent checkpoints on a filesystem, whatever the strategy writes.

A checkpoint path may be a single file (Lightning's default IO) or a directory (sharded DCP),
so completeness is never judged by trying to open it: a checkpoint counts only when its
sidecar marker ``<path>.complete`` exists, and the marker is written last, atomically, after
the data was renamed into place. The marker records every file's size so that truncation
after the fact (a full disk, a bad copy) is caught before a resume trusts the data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

MARKER_SUFFIX = ".complete"
TMP_PREFIX = ".tmp-"
_STEP_NAME = re.compile(r"^step=(\d+)\.ckpt$")
PathLike = Union[str, Path]


class CheckpointCorruptedError(RuntimeError):
    """A checkpoint exists but cannot be trusted; the message names the file and why."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]


def checkpoint_name(step: int) -> str:
    return f"step={step:08d}.ckpt"


def marker_path(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + MARKER_SUFFIX)


def _files(path: Path) -> Iterable[tuple[str, Path]]:
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            yield str(f.relative_to(path)), f
    elif path.is_file():
        yield "", path


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def manifest(path: PathLike, checksum: bool = False) -> dict[str, dict[str, Any]]:
    out = {}
    for rel, f in _files(Path(path)):
        entry: dict[str, Any] = {"size": f.stat().st_size}
        if checksum:
            entry["crc32"] = _crc32(f)
        out[rel] = entry
    return out


def remove_path(path: PathLike) -> None:
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def temp_path(final: PathLike, token: str) -> Path:
    final = Path(final)
    return final.with_name(f"{TMP_PREFIX}{final.name}-{token}")


def new_token() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def commit(tmp: PathLike, final: PathLike, meta: dict[str, Any], checksum: bool = False) -> Path:
    """Move a fully written checkpoint into place, then mark it complete (rank 0 only).

    The old marker goes first, so at no moment does a marker vouch for data that is being replaced.
    """
    tmp, final = Path(tmp), Path(final)
    if not tmp.exists():
        raise FileNotFoundError(f"checkpoint write left nothing at {tmp}; the strategy's save_checkpoint wrote elsewhere.")
    marker = marker_path(final)
    marker.unlink(missing_ok=True)
    if final.exists():
        remove_path(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    _write_json_atomic(marker, {**meta, "files": manifest(final, checksum), "checksum": checksum, "time": time.time()})
    _fsync_dir(final.parent)
    return final


def delete(path: PathLike) -> None:
    """Unmark first, then delete: a crash half way leaves an incomplete checkpoint, never a trusted broken one."""
    marker_path(path).unlink(missing_ok=True)
    remove_path(path)


def read_marker(path: PathLike) -> Optional[dict[str, Any]]:
    marker = marker_path(path)
    try:
        with open(marker) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def verify(path: PathLike) -> dict[str, Any]:
    """Raise `CheckpointCorruptedError` naming the file unless the checkpoint matches its marker."""
    path = Path(path)
    meta = read_marker(path)
    if meta is None:
        raise CheckpointCorruptedError(
            f"checkpoint {path} is incomplete: its completion marker {marker_path(path)} is missing or unreadable "
            "(the write was interrupted). Resume from an earlier checkpoint."
        )
    for rel, expected in meta.get("files", {}).items():
        f = path / rel if rel else path
        if not f.is_file():
            raise CheckpointCorruptedError(f"checkpoint file {f} is missing (listed in {marker_path(path)}).")
        size = f.stat().st_size
        if size != expected["size"]:
            raise CheckpointCorruptedError(
                f"checkpoint file {f} is truncated or corrupted: {size} bytes on disk, {expected['size']} when written."
            )
        if "crc32" in expected and _crc32(f) != expected["crc32"]:
            raise CheckpointCorruptedError(f"checkpoint file {f} is corrupted: its CRC32 differs from when it was written.")
    return meta


def list_complete(dirpath: PathLike, exclude: Iterable[PathLike] = ()) -> list[CheckpointInfo]:
    """Checkpoints in `dirpath` that have a marker, oldest first (not yet verified)."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    skip = {Path(p).resolve() for p in exclude}
    found = []
    for entry in dirpath.iterdir():
        if not entry.name.endswith(MARKER_SUFFIX) or entry.name.startswith(TMP_PREFIX):
            continue
        path = entry.with_name(entry.name[: -len(MARKER_SUFFIX)])
        if path.resolve() in skip or not path.exists():
            continue
        meta = read_marker(path)
        if meta is None:
            continue
        found.append(CheckpointInfo(path, int(meta.get("step", -1)), meta))
    return sorted(found, key=lambda c: (c.step, c.meta.get("time", 0.0)))


def latest_complete(
    dirpath: PathLike, exclude: Iterable[PathLike] = (), warn: Any = None
) -> Optional[Path]:
    """The newest checkpoint that passes `verify`; broken ones are reported through `warn` and skipped."""
    for info in reversed(list_complete(dirpath, exclude)):
        try:
            verify(info.path)
            return info.path
        except CheckpointCorruptedError as err:
            if warn is not None:
                warn(f"{err} Falling back to an earlier checkpoint.")
    return None


def stale_temporaries(dirpath: PathLike, keep: Iterable[PathLike] = ()) -> list[Path]:
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    keep_set = {Path(p).name for p in keep}
    return [p for p in dirpath.iterdir() if p.name.startswith(TMP_PREFIX) and p.name not in keep_set]
