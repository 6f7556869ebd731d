"""Who is building the C++ kernels in a build directory, and whether torch's lock there is stale.

torch's ``cpp_extension.load`` serialises the builds of one directory with a ``FileBaton``: a file named ``lock``,
created with ``O_EXCL`` and removed when the build ends. It records no owner, so a build killed mid-way (a second
Ctrl-C, the OOM killer, a scheduler's SIGKILL) leaves the file behind, and every later build of that directory
waits on it forever, silently.

So a lightning_npu build first takes its own lock: an exclusive ``flock`` on ``lock.owner``, next to torch's file,
held for the whole build. The kernel drops an ``flock`` when its process dies, so this lock cannot go stale, and
the file records the holder's pid, host and start time for the message of whoever waits. Once a process holds it,
a torch ``lock`` in the directory can only be the leftover of a dead build: it is removed, with one line naming
that build's owner.

Where the file system has no ``flock`` (some network mounts answer ``ENOLCK``), the record alone decides: a torch
lock is stale when its recorded owner is a process of this host that no longer exists, or when it is older than
`STALE_AFTER_S` (a cold build takes minutes) and its owner is on another host or unrecorded. There, two processes
that find the same stale lock at the same instant are not kept from racing; with ``flock`` they are.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: the record decides, as on a file system without flock
    fcntl = None  # type: ignore[assignment]

TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
OWNER = "lock.owner"  # ours: flock-held during a build, holds the owner record
STALE_AFTER_S = 3600.0  # without flock: an unrecorded or other host's lock this old is stale
REMIND_S = 60.0  # while waiting, one line a minute


@dataclass(frozen=True)
class Owner:
    """The process that holds (or held) a build directory."""

    pid: int
    host: str
    started: float  # time.time()

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {_ago(self.started)} ago"

    def alive(self) -> Optional[bool]:
        """Whether the process exists; None when it runs on another host (it cannot be checked from here)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def _ago(t: float) -> str:
    s = max(time.time() - t, 0.0)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.0f} h"


def read_owner(build_dir: Path) -> Optional[Owner]:
    """The last recorded owner of `build_dir`, or None (no record, or an unreadable one)."""
    try:
        data = json.loads((build_dir / OWNER).read_text() or "null")
        return Owner(int(data["pid"]), str(data["host"]), float(data["started"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _record(fd: int) -> None:
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, text.encode())


def _try_flock(fd: int) -> Optional[bool]:
    """True: acquired; False: another process holds it; None: this file system has no flock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _stale_by_record(build_dir: Path) -> Optional[str]:
    """Without flock: why torch's lock in `build_dir` is stale, or None when it may belong to a live build."""
    owner = read_owner(build_dir)
    try:
        age = time.time() - (build_dir / TORCH_LOCK).stat().st_mtime
    except FileNotFoundError:
        return None
    if owner is not None and owner.alive() is False:
        return f"left by {owner.describe()}, which no longer exists"
    if owner is not None and owner.alive() and owner.pid != os.getpid():
        return None
    if age > STALE_AFTER_S:
        who = owner.describe() if owner is not None else "no recorded owner"
        return f"{age / 60:.0f} min old, {who}"
    return None


@dataclass(frozen=True)
class LockState:
    """What `inspect` finds: a build in progress (`building`), or torch's lock left by a dead one (`stale`)."""

    building: Optional[Owner] = None
    in_progress: bool = False
    stale: Optional[str] = None


def inspect(build_dir: Path) -> LockState:
    """The lock state of `build_dir`, changing nothing (an flock taken here is released at once)."""
    torch_lock = (build_dir / TORCH_LOCK).exists()
    owner = read_owner(build_dir)
    try:
        fd = os.open(build_dir / OWNER, os.O_RDWR)
    except FileNotFoundError:
        fd = None
    if fd is not None:
        try:
            got = _try_flock(fd)
        finally:
            os.close(fd)  # releases the flock if it was taken
        if got is False:
            return LockState(building=owner, in_progress=True)
        if got is True:
            stale = f"left by {owner.describe()}" if owner else "no recorded owner"
            return LockState(stale=stale if torch_lock else None)
    if not torch_lock:
        return LockState()
    if fd is None:  # torch's lock without any lightning_npu record: not ours to judge by pid, only by age
        age = time.time() - (build_dir / TORCH_LOCK).stat().st_mtime
        return LockState(stale=f"{age / 60:.0f} min old, no recorded owner") if age > STALE_AFTER_S else \
            LockState(in_progress=True)
    why = _stale_by_record(build_dir)
    return LockState(stale=why) if why else LockState(building=owner, in_progress=True)


@contextmanager
def held(build_dir: Path, say: Callable[[str], None], poll_s: float = 0.5) -> Iterator[None]:
    """Hold `build_dir` for one build: wait (one line, then one a minute) while a live build holds it, remove a
    stale torch lock (one line), and record this process as the owner until the block ends."""
    fd = os.open(build_dir / OWNER, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        since = last = None
        while True:
            got = _try_flock(fd)
            if got is True:  # nobody builds here: a torch lock is a dead build's
                why = None
                if (build_dir / TORCH_LOCK).exists():
                    owner = read_owner(build_dir)
                    why = f"left by {owner.describe()}" if owner else "no recorded owner"
                break
            if got is None:  # no flock here: the record decides, and torch's own lock serialises the builds
                why = _stale_by_record(build_dir)
                if why is not None or not (build_dir / TORCH_LOCK).exists():
                    break
            now = time.monotonic()
            if since is None or now - last >= REMIND_S:
                owner = read_owner(build_dir)
                who = owner.describe() if owner else "another process"
                if since is None:
                    say(f"waiting for the fused C++ kernels' build in {build_dir} ({who}) to finish")
                    since = now
                else:
                    say(f"still waiting for the build in {build_dir} ({who}): {now - since:.0f} s so far")
                last = now
            time.sleep(poll_s)
        if why is not None:
            try:
                (build_dir / TORCH_LOCK).unlink()
                say(f"removed a stale build lock {build_dir / TORCH_LOCK} ({why}; its build was interrupted)")
            except FileNotFoundError:  # another process cleared it first (no-flock file systems only)
                pass
        _record(fd)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a finished build leaves no owner to blame
    finally:
        os.close(fd)
