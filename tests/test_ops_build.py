"""Building the C++ kernels, without compiling anything (the compile is faked): the cache key, the start and finish
lines, a stale build lock removed, a live one waited on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_npu.ops import build_lock, extension

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A private, empty cache and a fresh extension state."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)
    monkeypatch.delenv("LIGHTNING_NPU_CSRC", raising=False)
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setenv("CXX", "true")  # any program on PATH: nothing is compiled here
    return root


def _fake_compile(calls: list, check=lambda spec: None):
    """Stands in for torch's build: records the call, runs `check`, leaves the library, returns a module."""

    def compile_(spec):
        check(spec)
        calls.append(spec)
        spec.library.write_bytes(b"")
        return SimpleNamespace(simd=spec.simd)

    return compile_


# A process that holds a build directory as a lightning_npu build does, and creates torch's lock inside it
# (build_lock is loaded from its file: no package import, so it starts in a fraction of a second).
HOLDER = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("build_lock", sys.argv[1])
build_lock = sys.modules["build_lock"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_lock)
d = Path(sys.argv[2])
with build_lock.held(d, print):
    (d / "lock").touch()
    print("ready", flush=True)
    time.sleep(float(sys.argv[3]))
    (d / "lock").unlink()
"""


def _hold(build_dir: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, build_lock.__file__, str(build_dir), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _build_dir() -> Path:
    spec = extension.build_spec()
    extension._private_cache(spec.build_dir)
    return spec.build_dir


def _checkout(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name / "csrc"
    shutil.copytree(ROOT / "csrc", dst)
    return dst


def test_cache_is_keyed_by_the_install_path(cache, tmp_path, monkeypatch):
    """Two checkouts with identical sources, or one checkout under two Pythons, get two build directories."""
    a, b = _checkout(tmp_path, "a"), _checkout(tmp_path, "b")
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(a))
    spec_a = extension.build_spec()
    assert spec_a == extension.build_spec()  # stable
    assert spec_a.build_dir == cache / spec_a.name and spec_a.name.startswith(f"lightning_npu_ops_{spec_a.simd}_")
    assert spec_a.library.parent == spec_a.build_dir and spec_a.library.name.startswith(spec_a.name)
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(b))
    spec_b = extension.build_spec()
    assert spec_b.name != spec_a.name and spec_b.cflags == spec_a.cflags
    # the resolved path: a symlink to checkout a is checkout a
    link = tmp_path / "link-to-a"
    link.symlink_to(a, target_is_directory=True)
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(link))
    assert extension.build_spec().name == spec_a.name
    # another venv (sys.prefix) with the same checkout
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(a))
    prefix = sys.prefix
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert extension.build_spec().name != spec_a.name
    monkeypatch.setattr(sys, "prefix", prefix)
    assert extension.build_spec().name == spec_a.name
    # and still the sources: an edit is a new key
    (a / "gelu.cpp").write_text((a / "gelu.cpp").read_text() + "\n// edited\n")
    assert extension.build_spec().name != spec_a.name
    assert not cache.exists()  # computing the key creates nothing


def test_a_build_says_when_it_starts_and_ends_and_a_cached_one_says_nothing(cache, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(extension, "_compile", _fake_compile(calls))
    module = extension.load()
    assert module is not None and len(calls) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("lightning_npu: building the fused C++ kernels") and "once per install (`lightning-npu build-ops`" in err[0]
    assert err[1].startswith("lightning_npu: built the fused C++ kernels in ") and str(calls[0].library) in err[1]
    assert calls[0].build_dir.parent == cache and calls[0].built
    assert (calls[0].build_dir / build_lock.OWNER).read_text() == ""  # a finished build leaves no owner record
    monkeypatch.setattr(extension, "_state", {})  # another process: the library is there, nothing is printed
    assert extension.load() is not None and len(calls) == 2 and capsys.readouterr().err == ""
    # a failed build closes its start line, and load() falls back with its one warning
    monkeypatch.setattr(extension, "_state", {})
    calls[0].library.unlink()

    def broken(spec):
        raise RuntimeError("Error building extension 'x'\nninja: build stopped")

    monkeypatch.setattr(extension, "_compile", broken)
    with pytest.warns(UserWarning, match=r"fused C\+\+ ops unavailable \(Error building extension 'x'\)"):
        assert extension.load() is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "failed after" in err[1] and "RuntimeError" in err[1], err


def test_a_stale_lock_left_by_a_killed_build_is_removed_and_the_build_proceeds(cache, monkeypatch, capsys):
    build_dir = _build_dir()
    holder = _hold(build_dir, 600)
    holder.send_signal(signal.SIGKILL)  # killed mid-build: torch's lock stays, and so does the owner record
    holder.wait(30)
    assert (build_dir / build_lock.TORCH_LOCK).exists()
    assert json.loads((build_dir / build_lock.OWNER).read_text())["pid"] == holder.pid
    assert build_lock.inspect(build_dir).stale.startswith(f"left by pid {holder.pid} on {socket.gethostname()}")

    def check(spec):  # torch would wait forever on its lock; it is gone, and the record names this process
        assert not (spec.build_dir / build_lock.TORCH_LOCK).exists()
        assert build_lock.read_owner(spec.build_dir).pid == os.getpid()

    calls: list = []
    monkeypatch.setattr(extension, "_compile", _fake_compile(calls, check))
    assert extension.load() is not None and len(calls) == 1
    err = capsys.readouterr().err.splitlines()
    removed = [line for line in err if "stale build lock" in line]
    assert len(removed) == 1 and f"pid {holder.pid}" in removed[0] and "interrupted" in removed[0], err
    assert len(err) == 3 and "built the fused C++ kernels in" in err[-1]  # removed, started, finished
    assert build_lock.inspect(build_dir) == build_lock.LockState()


def test_a_live_build_is_waited_on_with_a_message(cache, monkeypatch, capsys):
    build_dir = _build_dir()
    holder = _hold(build_dir, 2.0)
    state = build_lock.inspect(build_dir)
    assert state.in_progress and state.building.pid == holder.pid and state.stale is None

    def check(spec):  # only once the other build has ended (it removed its torch lock and let go)
        assert not (spec.build_dir / build_lock.TORCH_LOCK).exists()
        assert build_lock.read_owner(spec.build_dir).pid == os.getpid()

    calls: list = []
    monkeypatch.setattr(extension, "_compile", _fake_compile(calls, check))
    start = time.monotonic()
    assert extension.load() is not None and len(calls) == 1
    assert time.monotonic() - start >= 1.0
    err = capsys.readouterr().err
    assert err.count("waiting for the fused C++ kernels' build") == 1 and f"pid {holder.pid}" in err, err
    assert "stale" not in err  # its lock was never taken for a dead build's
    assert holder.wait(30) == 0


def test_without_flock_the_owner_record_decides(cache, monkeypatch, capsys):
    monkeypatch.setattr(build_lock, "_try_flock", lambda fd: None)  # e.g. an NFS mount answering ENOLCK
    build_dir = _build_dir()
    lock, owner = build_dir / build_lock.TORCH_LOCK, build_dir / build_lock.OWNER
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    try:
        here = socket.gethostname()
        lock.touch()
        owner.write_text(json.dumps({"pid": sleeper.pid, "host": here, "started": time.time()}))
        assert build_lock.inspect(build_dir).in_progress  # a live owner on this host
        owner.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": time.time()}))
        assert build_lock.inspect(build_dir).in_progress  # another host's, and recent: it may be building
        old = time.time() - 2 * build_lock.STALE_AFTER_S
        os.utime(lock, (old, old))
        assert "min old" in build_lock.inspect(build_dir).stale  # ... but not for two hours
        owner.write_text(json.dumps({"pid": dead.pid, "host": here, "started": time.time()}))
        lock.touch()
        assert "no longer exists" in build_lock.inspect(build_dir).stale
        calls: list = []
        monkeypatch.setattr(extension, "_compile", _fake_compile(calls))
        assert extension.load() is not None and len(calls) == 1 and not lock.exists()
        assert sum("stale build lock" in line for line in capsys.readouterr().err.splitlines()) == 1
    finally:
        sleeper.kill()
        sleeper.wait(30)


def test_build_ops_builds_ahead_of_time_and_fails_with_one_line(cache, monkeypatch, capsys):
    from lightning_npu import cli

    calls: list = []
    monkeypatch.setattr(extension, "_compile", _fake_compile(calls))
    cli.main(["build-ops"])
    out, err = capsys.readouterr()
    assert len(calls) == 1 and out.strip() == f"fused C++ kernels ready: {calls[0].library}"
    assert "built the fused C++ kernels in" in err and "build-ops" not in err  # no hint to run what runs
    assert extension.status().built and extension.status().loaded
    monkeypatch.setattr(extension, "_state", {})  # built already (another process): loaded, no build lines
    cli.main(["build-ops"])
    out, err = capsys.readouterr()
    assert len(calls) == 2 and out.startswith("fused C++ kernels ready") and err == ""

    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["build-ops"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.strip() == ("lightning-npu build-ops: the fused C++ kernels could not be built: no "
                                               "C++ compiler ('no-such-compiler' not on PATH)")
