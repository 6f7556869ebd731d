"""The one commit path for every checkpoint the package writes (sync or async, file or DCP directory).

A save writes into a hidden sibling ``.tmp-<name>-<token>``; once every rank's write is complete,
rank 0 calls :func:`commit`, once:

1. an existing ``<name>`` is renamed aside to ``.old-<name>-<token>`` (then its marker, if any);
2. the temporary is renamed to ``<name>`` (the commit point);
3. the completion marker ``<name>.complete`` is written, atomically (callbacks ask for one);
4. the aside copy is deleted (and the leftovers of earlier crashed saves of that name).

Nothing is deleted before the new data is in place, so a crash at any point leaves the last good
checkpoint loadable: discovery (:func:`list_complete`) and :func:`resolve_checkpoint_path` fall back
to the aside copy. A marker records every file's size and CRC32 (computed before the rename: DCP shards
while they are written, by the rank that writes them), so a truncated, flipped or swapped file is caught
before a load trusts it (:func:`verify`, :func:`verify_marked`); ``LIGHTNING_NPU_CHECKSUM=0`` records and
checks sizes only. Markers carry a ``run`` id so that pruning never touches another run's checkpoints.
Leftovers of crashed saves are removed by :func:`clean_stale` / :func:`clean_leftovers`, which spare saves
still in flight: this process's (:func:`hold`) and another's (its token names a live process on this host,
or its files changed within `STALE_AFTER_S`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

log = logging.getLogger(__name__)

MARKER_SUFFIX = ".complete"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
CHECKSUM_ENV = "LIGHTNING_NPU_CHECKSUM"
# a leftover whose owner cannot be told dead (another host, an older token) is stale once idle this long
STALE_AFTER_S = 600.0
# an unmarked checkpoint (crash between rename and marker, or during a prune) once idle this long: a live
# commit writes its marker milliseconds after the rename
UNMARKED_AFTER_S = 10.0
PathLike = Union[str, Path]

_TOKEN = r"\d+-[0-9a-f]{8}"
_TEMP_NAME = re.compile(rf"^\.(tmp|old)-(.+)-({_TOKEN})$")
# names of earlier versions: the strategy's ``.<name>.tmp-<hex12>`` / ``.<name>.old-<hex12>`` (nested in ``.tmp-``)
_LEGACY_NAME = re.compile(r"^\.(.+)\.(tmp|old)-([0-9a-f]{12})$")


class CheckpointCorruptedError(RuntimeError):
    """A checkpoint exists but cannot be trusted; the message names the file and why."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]


def checksums_enabled() -> bool:
    """Whether CRC32s are recorded and verified: yes unless ``LIGHTNING_NPU_CHECKSUM=0`` (sizes always are)."""
    return os.environ.get(CHECKSUM_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@dataclass
class CommitRequest:
    """What a caller of ``trainer.save_checkpoint(path, storage_options=CommitRequest(...))`` wants committed
    with the data (a marker), and where it learns that the commit happened (``done``, then ``committed`` on
    rank 0, or ``error``). Strategies that commit their own writes (npu_hybrid) accept it. `checksum`: record
    CRC32s with the sizes (unless ``LIGHTNING_NPU_CHECKSUM=0``)."""

    marker: Optional[dict[str, Any]] = None
    checksum: bool = True
    done: threading.Event = field(default_factory=threading.Event)
    committed: Optional[Path] = None
    error: Optional[BaseException] = None


# ---- names and tokens -----------------------------------------------------------------------
# 4 hex digits of the host name in every token: a leftover of this host whose process is gone is stale at once
_HOST_TAG = f"{zlib.crc32(socket.gethostname().encode()) & 0xFFFF:04x}"


def new_token() -> str:
    """``<pid>-<host tag><random>``: which process wrote a temporary, so that cleanup can tell it dead."""
    return f"{os.getpid()}-{_HOST_TAG}{uuid.uuid4().hex[:4]}"


def temp_path(final: PathLike, token: str) -> Path:
    final = Path(final)
    return final.with_name(f"{TMP_PREFIX}{final.name}-{token}")


def aside_path(final: PathLike, token: str) -> Path:
    final = Path(final)
    return final.with_name(f"{OLD_PREFIX}{final.name}-{token}")


def marker_path(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + MARKER_SUFFIX)


def _parse(name: str) -> Optional[tuple[str, str, str]]:
    """(kind "tmp"|"old", final name, token) of a temporary or aside name, else None."""
    m = _TEMP_NAME.match(name)
    if m:
        return m.group(1), m.group(2), m.group(3)
    m = _LEGACY_NAME.match(name)
    if m:
        return m.group(2), m.group(1), m.group(3)
    return None


_live: set[str] = set()
_live_finals: dict[str, int] = {}  # final names of saves in flight here (unmarked between rename and marker)
_live_lock = threading.Lock()
_final_of: dict[str, str] = {}


def hold(token: str, final: Optional[PathLike] = None) -> None:
    """Mark a save in flight: :func:`clean_stale` leaves its temporary and aside copies alone (and
    :func:`clean_leftovers` its `final` checkpoint until its marker is written)."""
    with _live_lock:
        _live.add(token)
        if final is not None:
            name = Path(final).name
            _final_of[token] = name
            _live_finals[name] = _live_finals.get(name, 0) + 1


def release(token: str) -> None:
    with _live_lock:
        _live.discard(token)
        name = _final_of.pop(token, None)
        if name is not None:
            _live_finals[name] -= 1
            if not _live_finals[name]:
                del _live_finals[name]


def _is_live(token: str) -> bool:
    with _live_lock:
        return token in _live


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # exists but not ours (PermissionError), or not a pid at all
    return True


def _owner_gone(token: str) -> bool:
    """The save of `token` is known dead: a process of this host that no longer runs, or this process (whose
    live saves are held)."""
    pid, _, tag = token.partition("-")
    if not tag.startswith(_HOST_TAG) or not pid.isdigit():
        return False
    return int(pid) == os.getpid() or not _pid_alive(int(pid))


def _idle_s(path: Path) -> float:
    """Seconds since anything at `path` (a file, or a directory and what it holds) last changed."""
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            for p in path.rglob("*"):
                try:
                    newest = max(newest, p.lstat().st_mtime)
                except OSError:
                    pass
    except OSError:
        return float("inf")
    return time.time() - newest


def _stale(token: str, entry: Path) -> bool:
    return not _is_live(token) and (_owner_gone(token) or _idle_s(entry) >= STALE_AFTER_S)


# ---- filesystem helpers ---------------------------------------------------------------------
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


def _move(src: Path, dst: Path) -> None:
    """Every rename of the commit goes through here (one place for fault-injection tests)."""
    os.replace(src, dst)


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = temp_path(path, new_token())
    try:
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:  # disk full: no temporary left behind
        tmp.unlink(missing_ok=True)
        raise


def _files(path: Path) -> Iterable[tuple[str, Path]]:
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            yield str(f.relative_to(path)), f
    elif path.is_file():
        yield "", path


# verified CRC32s by (device, inode, size, mtime): discovery and the load that follows read a file once
_crc_cache: dict[tuple[int, int, int, int], str] = {}
_crc_lock = threading.Lock()


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _crc32_matches(path: Path, expected: str) -> bool:
    key = _stat_key(path)
    with _crc_lock:
        if _crc_cache.get(key) == expected:
            return True
    if _crc32(path) != expected:
        return False
    with _crc_lock:
        if len(_crc_cache) > 65536:
            _crc_cache.clear()
        _crc_cache[key] = expected
    return True


class ChecksumStream:
    """A write stream that keeps the size and CRC32 of what goes through it: a file's checksum without
    reading it back. `checksum=False` counts the size only."""

    def __init__(self, raw: Any, checksum: bool = True) -> None:
        self.raw, self.checksum = raw, checksum
        self.crc, self.size = 0, 0

    def write(self, data: Any) -> int:
        n = self.raw.write(data)
        view = memoryview(data).cast("B")
        if self.checksum:
            self.crc = zlib.crc32(view[:n] if n is not None and n < len(view) else view, self.crc)
        self.size += len(view) if n is None else n
        return n

    def entry(self) -> dict[str, Any]:
        return {"size": self.size, **({"crc32": f"{self.crc:08x}"} if self.checksum else {})}

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self.raw, name)


def manifest(path: PathLike, checksum: bool = True,
             known: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, dict[str, Any]]:
    """Every file's size (and CRC32 with `checksum`, unless ``LIGHTNING_NPU_CHECKSUM=0``), relative to `path`.
    `known` entries (computed while writing) are taken where their size matches the file's."""
    checksum = checksum and checksums_enabled()
    known = known or {}
    out = {}
    for rel, f in _files(Path(path)):
        entry: dict[str, Any] = {"size": f.stat().st_size}
        if checksum:
            k = known.get(rel) or {}
            entry["crc32"] = k["crc32"] if k.get("size") == entry["size"] and "crc32" in k else _crc32(f)
        out[rel] = entry
    return out


# ---- the commit -----------------------------------------------------------------------------
def commit(tmp: PathLike, final: PathLike, token: str, marker: Optional[dict[str, Any]] = None,
           checksum: bool = True, known: Optional[dict[str, dict[str, Any]]] = None) -> Path:
    """Rank 0, after every rank finished writing `tmp`: make it `final`, atomically (see the module doc).

    With `marker`, ``<final>.complete`` records it plus the files' sizes and CRC32s (`checksum`; `known` are
    those computed while writing). The manifest is taken before the rename, so that the commit point and the
    marker are milliseconds apart.
    """
    tmp, final = Path(tmp), Path(final)
    if not _exists(tmp):
        raise FileNotFoundError(f"checkpoint write left nothing at {tmp}; the strategy's save_checkpoint wrote elsewhere.")
    files = manifest(tmp, checksum, known) if marker is not None else None
    aside = aside_path(final, token)
    old_marker = marker_path(final)
    # data first, then its marker: between the two, the marker still vouches for the aside copy (same files)
    if _exists(final):
        _move(final, aside)
    if _exists(old_marker):
        _move(old_marker, marker_path(aside))
    _move(tmp, final)
    _fsync_dir(final.parent)
    if marker is not None:
        recorded = bool(files) and all("crc32" in e for e in files.values())
        try:
            _write_json_atomic(old_marker, {**marker, "files": files, "checksum": recorded, "time": time.time()})
        except Exception:  # e.g. disk full: the failed save leaves the previous state, not an unmarked copy
            _undo(final, aside, old_marker)
            raise
        _fsync_dir(final.parent)
    remove_path(aside)
    marker_path(aside).unlink(missing_ok=True)
    clean_stale(final.parent, names=[final.name])  # older crashed saves of this name are obsolete now
    return final


def _undo(final: Path, aside: Path, old_marker: Path) -> None:
    """Put back what an overwrite set aside, after its marker could not be written (best effort: a failure here
    leaves the aside copy, which discovery falls back to)."""
    try:
        remove_path(final)
        if _exists(aside):
            _move(aside, final)
        if _exists(marker_path(aside)):
            _move(marker_path(aside), old_marker)
        _fsync_dir(final.parent)
    except OSError as err:
        log.warning("Could not put back %s after its marker failed (%s); discovery loads %s.", final, err, aside)


def delete(path: PathLike) -> None:
    """Unmark first, then delete: a crash half way leaves an incomplete checkpoint, never a trusted broken one.

    An aside copy (what discovery lists for an interrupted overwrite) takes its checkpoint's marker along."""
    path = Path(path)
    parsed = _parse(path.name)
    if parsed is not None and parsed[0] == "old" and not _exists(path.with_name(parsed[1])):
        marker_path(path.with_name(parsed[1])).unlink(missing_ok=True)
    marker_path(path).unlink(missing_ok=True)
    remove_path(path)


def clean_stale(dirpath: PathLike, names: Optional[Iterable[str]] = None) -> list[Path]:
    """Remove temporaries and aside copies of saves that crashed (rank 0), except those of live saves.

    A save is live while this process holds its token (:func:`hold`), or while its token names a process of
    this host that still runs; a token of another host (or an older version) counts as dead once nothing in
    it changed for `STALE_AFTER_S`. An aside copy is removed only when its checkpoint exists again and is at
    least as trusted (marked, or neither is); otherwise it is the last good copy and stays where discovery
    finds it. `names` limits the cleanup to those checkpoint names.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    only = set(names) if names is not None else None
    removed = []
    for entry in list(dirpath.iterdir()):
        name = entry.name[: -len(MARKER_SUFFIX)] if entry.name.endswith(MARKER_SUFFIX) else entry.name
        parsed = _parse(name)
        if parsed is None or entry.name.endswith(MARKER_SUFFIX):
            continue
        kind, final_name, token = parsed
        if (only is not None and final_name not in only) or not _stale(token, entry):
            continue
        if kind == "old":
            final = dirpath / final_name
            aside_marked = marker_path(entry).exists()
            final_ok = _exists(final) and (
                _read_marker_quiet(final) is not None or not (aside_marked or marker_path(final).exists())
            )
            if not final_ok:
                continue
            marker_path(entry).unlink(missing_ok=True)
        remove_path(entry)
        removed.append(entry)
    return removed


def clean_leftovers(dirpath: PathLike, unmarked: "re.Pattern[str]") -> list[Path]:
    """:func:`clean_stale`, plus the checkpoints named like `unmarked` that have no marker (a crash between
    rename and marker, or half way through :func:`delete`) and markers whose checkpoint is gone. For a folder
    whose every checkpoint is marked (DynamicCheckpoint's): there, an unmarked one was never trusted."""
    dirpath = Path(dirpath)
    removed = clean_stale(dirpath)
    if not dirpath.is_dir():
        return removed
    with _live_lock:
        live_finals = set(_live_finals)
    for entry in sorted(dirpath.iterdir()):
        if entry.name.endswith(MARKER_SUFFIX):
            target = entry.with_name(entry.name[: -len(MARKER_SUFFIX)])
            if unmarked.fullmatch(target.name) and not _exists(target) and not _asides(target) \
                    and target.name not in live_finals and _idle_s(entry) >= UNMARKED_AFTER_S:
                entry.unlink(missing_ok=True)
                removed.append(entry)
        elif unmarked.fullmatch(entry.name) and not marker_path(entry).exists() \
                and entry.name not in live_finals and _idle_s(entry) >= UNMARKED_AFTER_S:
            remove_path(entry)
            removed.append(entry)
    return removed


# ---- markers and discovery ------------------------------------------------------------------
def _warn(message: str) -> None:
    try:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(message)
    except ImportError:  # pragma: no cover
        warnings.warn(message)


def _check_marker(data: Any) -> Optional[str]:
    """Why a parsed marker is malformed, or None."""
    if not isinstance(data, dict):
        return f"it holds a {type(data).__name__}, not a JSON object"
    step = data.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"its 'step' is {step!r}, not an integer"
    files = data.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) for v in files.values()
    ):
        return "its 'files' manifest is malformed"
    return None


def _load_marker(marker: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    try:
        with open(marker) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as err:
        return None, f"it is unreadable ({err.__class__.__name__}: {err})"
    problem = _check_marker(data)
    return (None, problem) if problem else (data, None)


def _read_marker_quiet(path: PathLike) -> Optional[dict[str, Any]]:
    return _load_marker(marker_path(path))[0]


def read_marker(path: PathLike) -> Optional[dict[str, Any]]:
    """The marker of checkpoint `path`, or None (missing; malformed ones are reported with a warning)."""
    data, problem = _load_marker(marker_path(path))
    if problem:
        _warn(f"Ignoring the checkpoint marker {marker_path(path)}: {problem}.")
    return data


_FIX = "Load an earlier checkpoint (DynamicCheckpoint.find_latest skips broken ones)"


def verify(path: PathLike, meta: Optional[dict[str, Any]] = None, crc_of: Optional[Iterable[str]] = None,
           marker: Optional[PathLike] = None) -> dict[str, Any]:
    """Raise `CheckpointCorruptedError` naming the file unless the checkpoint matches its marker (or `meta`).

    Sizes are checked for every listed file; CRC32s (where recorded, unless ``LIGHTNING_NPU_CHECKSUM=0``) for
    the files in `crc_of` (default all): ranks that load together split the reading."""
    path = Path(path)
    marker = Path(marker) if marker is not None else marker_path(path)
    if meta is None:
        meta, problem = _load_marker(marker)
        if meta is None:
            why = problem or "is missing (the write was interrupted)"
            raise CheckpointCorruptedError(
                f"checkpoint {path} is incomplete: its completion marker {marker} "
                f"{'is malformed: ' + why if problem else why}. Resume from an earlier checkpoint."
            )
    files = meta.get("files", {})
    crc_of = set(files) if crc_of is None else set(crc_of)
    check_crc = checksums_enabled()
    for rel, expected in sorted(files.items()):
        f = path / rel if rel else path
        if not f.is_file():
            raise CheckpointCorruptedError(f"checkpoint file {f} is missing (listed in {marker}). {_FIX}.")
        size = f.stat().st_size
        if size != expected["size"]:
            raise CheckpointCorruptedError(
                f"checkpoint file {f} is truncated or corrupted: {size} bytes on disk, {expected['size']} when "
                f"written (recorded in {marker}). {_FIX}."
            )
    for rel, expected in sorted(files.items()):
        f = path / rel if rel else path
        if check_crc and rel in crc_of and "crc32" in expected and not _crc32_matches(f, expected["crc32"]):
            raise CheckpointCorruptedError(
                f"checkpoint file {f} is corrupted: its CRC32 differs from the one recorded in {marker} when it "
                f"was written (flipped bytes, or a file of another checkpoint). {_FIX}; if you changed the file "
                "on purpose, delete the marker to load it unverified."
            )
    return meta


def find_marker(path: PathLike) -> Optional[Path]:
    """The marker that vouches for checkpoint `path` (through a symlink, e.g. ModelCheckpoint's ``last.ckpt``
    link; for an aside copy, also its checkpoint's marker not yet moved aside), or None."""
    path = Path(path)
    candidates = [marker_path(path)]
    try:
        candidates.append(marker_path(path.resolve()))
    except OSError:
        pass
    parsed = _parse(path.name)
    if parsed is not None and parsed[0] == "old" and not _exists(path.with_name(parsed[1])):
        candidates.append(marker_path(path.with_name(parsed[1])))
    return next((m for m in candidates if m.is_file()), None)


def verify_marked(path: PathLike, crc_of: Optional[Iterable[str]] = None) -> Optional[dict[str, Any]]:
    """:func:`verify` for a checkpoint loaded by path: one with a marker must match it (a malformed marker is
    an error too); one without (an older version's, or Lightning's own) is loaded unverified (None)."""
    path = Path(path)
    marker = find_marker(path)
    if marker is None:
        return None
    meta, problem = _load_marker(marker)
    if meta is None:
        raise CheckpointCorruptedError(
            f"checkpoint {path} cannot be verified: its marker {marker} is malformed ({problem}). {_FIX}, or "
            "delete the marker to load the checkpoint unverified."
        )
    return verify(path, meta, crc_of=crc_of, marker=marker)


def verify_for_load(path: PathLike, rank: int = 0, world: int = 1, gather: Any = None) -> None:
    """:func:`verify_marked` for `world` ranks that load `path` together (a collective when `gather`, an
    all-gather of one object, is given): every rank checks every size and the CRC32s of its share of the files
    (largest first, dealt out round robin), and all raise the same `CheckpointCorruptedError`."""
    problem: Optional[str] = None
    marker = find_marker(path)
    if marker is not None:
        meta = _load_marker(marker)[0] or {}
        files = sorted((meta.get("files") or {}).items(), key=lambda kv: (-int(kv[1].get("size", 0)), kv[0]))
        share = [rel for i, (rel, _) in enumerate(files) if i % max(1, world) == rank]
        try:
            verify_marked(path, crc_of=share)
        except CheckpointCorruptedError as err:
            problem = str(err)
    if gather is not None:
        problem = next((p for p in gather(problem) if p), None)
    if problem is not None:
        raise CheckpointCorruptedError(problem)


def _asides(final: Path) -> list[Path]:
    """Aside copies of `final` left by overwrites that crashed, newest first."""
    found = []
    if not final.parent.is_dir():
        return found
    for p in final.parent.iterdir():
        parsed = _parse(p.name)
        if parsed and parsed[0] == "old" and parsed[1] == final.name and _exists(p):
            found.append(p)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def list_complete(dirpath: PathLike, exclude: Iterable[PathLike] = ()) -> list[CheckpointInfo]:
    """Checkpoints in `dirpath` that have a well-formed marker, oldest first (not yet verified).

    A checkpoint caught between the renames of an overwrite is listed under its aside copy's path.
    Malformed or stray markers are skipped with a warning.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    skip = {Path(p).resolve() for p in exclude}
    found: dict[Path, CheckpointInfo] = {}
    aside_markers = []
    for entry in dirpath.iterdir():
        if not entry.name.endswith(MARKER_SUFFIX) or entry.name.startswith(TMP_PREFIX):
            continue
        name = entry.name[: -len(MARKER_SUFFIX)]
        if not name:
            _warn(f"Ignoring the stray checkpoint marker {entry}: it names no checkpoint.")
            continue
        parsed = _parse(name)
        if parsed is not None:
            if parsed[0] == "old":
                aside_markers.append((dirpath / parsed[1], dirpath / name))
            continue
        path = dirpath / name
        meta = read_marker(path)
        if meta is None:
            continue
        if not _exists(path):
            asides = _asides(path)
            if not asides:
                _warn(f"Ignoring the stray checkpoint marker {entry}: {path} does not exist.")
                continue
            path = asides[0]  # crashed between "data aside" and "marker aside": the marker vouches for it
        found[dirpath / name] = CheckpointInfo(path, int(meta["step"]), meta)
    for final, aside in aside_markers:
        if final in found and found[final].path == final or not _exists(aside):
            continue  # the overwrite completed (the aside copy is a leftover) or nothing to load
        meta = read_marker(aside)
        if meta is not None:
            found[final] = CheckpointInfo(aside, int(meta["step"]), meta)
    infos = [i for i in found.values() if i.path.resolve() not in skip]
    return sorted(infos, key=lambda c: (c.step, c.meta.get("time", 0.0)))


def latest_complete(dirpath: PathLike, exclude: Iterable[PathLike] = (), warn: Any = None) -> Optional[Path]:
    """The newest checkpoint that passes `verify`; broken ones are reported through `warn` and skipped."""
    for info in reversed(list_complete(dirpath, exclude)):
        try:
            verify(info.path, info.meta)
            return info.path
        except CheckpointCorruptedError as err:
            if warn is not None:
                warn(f"{err} Falling back to an earlier checkpoint.")
    return None


def resolve_checkpoint_path(path: PathLike, is_loadable: Any = None) -> Path:
    """`path`, or the complete copy set aside by an overwrite that crashed before its final rename."""
    path = Path(path)
    if path.exists():
        return path
    for candidate in _asides(path):
        if is_loadable is None or is_loadable(candidate):
            log.warning(f"Checkpoint {path} is missing; loading {candidate}, set aside by an interrupted overwrite.")
            return candidate
    # Lightning's words first (scripts and tests match on them), then ours
    raise FileNotFoundError(f"Checkpoint file not found: {path} (it does not exist, and no complete copy was set "
                            "aside by an interrupted overwrite).")
