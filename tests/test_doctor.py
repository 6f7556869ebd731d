"""`lightning-npu doctor`: on this machine (no accelerator: exit 0, trains on CPU) and, with `npu-smi`,
`hccn_tool` and `nvidia-smi` faked on PATH and a fake CANN toolkit, the NPU and CUDA branches."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_npu import doctor
from lightning_npu.ops import build_lock, extension

ROOT = Path(__file__).resolve().parents[1]

NPU_SMI_INFO = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 97.8        41                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3162 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 99.1        91                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3170 / 65536         |
+===========================+===============+====================================================+
"""
BOARD = "NPU ID : 0\nSoftware Version : 23.0.6\nFirmware Version : 7.1.0.5.220\n"


def _tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HCCL_") and k != "ASCEND_TOOLKIT_HOME"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env.update(extra)
    return env


def _by_name(checks):
    return {f"{c.section}: {c.name}": c for c in checks}


def test_this_machine_trains_on_cpu_and_exits_0(tmp_path, monkeypatch, capsys):
    env = _env(tmp_path, PYTHONPATH=str(ROOT), LIGHTNING_NPU_NO_EXT="1")  # the fused-ops lines: tested below
    cmd = [sys.executable, "-m", "lightning_npu.cli", "doctor"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no accelerator: lightning-npu will train on CPU" in proc.stdout
    assert "ready: lightning-npu will train on CPU." in proc.stdout
    assert " ok  backend: gloo " in proc.stdout  # the 1-process gloo group did its all-reduce
    code = doctor.main(["--json"], env=env)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ready"] and report["accelerator"] == "cpu"
    assert report["facts"]["torch"] and {"section", "name", "status", "detail", "fix"} <= set(report["checks"][0])


def test_npu_branch_with_faked_tools(tmp_path, monkeypatch):
    toolkit = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    (toolkit / "aarch64-linux").mkdir(parents=True)
    (toolkit / "aarch64-linux" / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\n"
                                                                           "version=8.0.RC2\n")
    env = _env(tmp_path, ASCEND_TOOLKIT_HOME=str(toolkit), HCCL_GROUP_SIZE="16", HCCL_LARGE_BUFFER="1",
               HCCL_CONNECT_TIMEOUT="60", HCCL_BUFFSIZE="400", HCCL_OP_EXPANSION_MODE="AIV", HCCL_IF_IP="10.0.0.x",
               HCCL_BUFSIZE="200")
    (tmp_path / "smi.txt").write_text(NPU_SMI_INFO)
    (tmp_path / "board.txt").write_text(BOARD)
    _tool(tmp_path / "bin", "npu-smi",
          f'if [ "$2" = "-t" ]; then cat "{tmp_path}/board.txt"; else cat "{tmp_path}/smi.txt"; fi\n')
    _tool(tmp_path / "bin", "hccn_tool",
          'if [ "$3" = "-link" ]; then [ "$2" = 0 ] && echo "link status: UP" || echo "link status: DOWN"; '
          'else echo "ipaddr:192.168.1.$2"; echo "netmask:255.255.255.0"; fi\n')
    checks, facts = doctor.collect(env, skip=("backend", "fused ops"))
    got = _by_name(checks)
    assert got["versions: CANN toolkit"].detail.startswith("8.0.RC2")
    assert got["versions: NPU driver"].detail == "23.0.6" and got["versions: NPU firmware"].detail == "7.1.0.5.220"
    assert got["devices: npu 0"].status == "ok" and "3162/65536 MB" in got["devices: npu 0"].detail
    assert got["devices: npu 1"].status == "warn" and "91 C" in got["devices: npu 1"].detail  # >= 85 C
    # torch_npu is not installed here: npu-smi sees NPUs that torch cannot use, a hard failure with the fix
    torch_devices = got["devices: torch devices"]
    assert torch_devices.status == "fail" and "pip install torch-npu" in torch_devices.fix
    # HCCL: the two names from the guides do not exist; a typo is flagged; out-of-range values warned; good ones ok
    assert got["hccl: HCCL_GROUP_SIZE"].status == "warn" and "does not exist" in got["hccl: HCCL_GROUP_SIZE"].detail
    assert got["hccl: HCCL_LARGE_BUFFER"].status == "warn" and "HCCL_BUFFSIZE" in got["hccl: HCCL_LARGE_BUFFER"].detail
    assert "not a documented HCCL variable" in got["hccl: HCCL_BUFSIZE"].detail
    timeout = got["hccl: HCCL_CONNECT_TIMEOUT"]
    assert timeout.status == "warn" and "[120, 7200]" in timeout.detail
    assert got["hccl: HCCL_IF_IP"].status == "warn"
    assert got["hccl: HCCL_BUFFSIZE"].status == "ok" and got["hccl: HCCL_OP_EXPANSION_MODE"].status == "ok"
    # RoCE through hccn_tool: device 0 up, device 1 down
    assert got["rdma: roce 0"].status == "ok" and "192.168.1.0" in got["rdma: roce 0"].detail
    assert got["rdma: roce 1"].status == "warn" and "hccn_tool -i 1 -link -g" in got["rdma: roce 1"].fix
    text = doctor.render(checks, facts)
    assert "FAIL" in text and "not ready" in text and "fixes:" in text
    assert doctor.main([], env=env) == 1  # hard failure -> non-zero (this run includes the gloo backend check)


def test_npu_without_toolkit_and_cuda_branch(tmp_path):
    env = _env(tmp_path, ASCEND_TOOLKIT_HOME=str(tmp_path / "nowhere"))
    (tmp_path / "smi.txt").write_text(NPU_SMI_INFO)
    _tool(tmp_path / "bin", "npu-smi", f'cat "{tmp_path}/smi.txt"\n')
    if Path("/usr/local/Ascend").exists():
        pytest.skip("a real CANN install is present")
    got = _by_name(doctor.collect(env, skip=("backend", "fused ops"))[0])
    assert "rdma: hccn_tool" in got and got["rdma: hccn_tool"].status == "info"
    fails = [c for c in doctor.collect(env, skip=("backend", "fused ops"))[0] if c.status == "fail"]
    assert any("set_env.sh" in c.fix for c in fails)

    cuda = tmp_path / "cuda"
    cuda.mkdir()
    cuda_env = _env(cuda)
    _tool(cuda / "bin", "nvidia-smi", 'echo "0, NVIDIA H100 80GB HBM3, 550.54.15, 81559, 80000, 88"\n'
                                      'echo "1, NVIDIA H100 80GB HBM3, 550.54.15, 81559, 81000, 40"\n')
    got = _by_name(doctor.collect(cuda_env, skip=("backend", "fused ops"))[0])
    assert got["versions: CUDA driver"].detail == "550.54.15"
    assert got["devices: gpu 0"].status == "warn" and got["devices: gpu 1"].status == "ok"
    # this torch is a CPU build: the GPUs nvidia-smi sees are unusable, and the fix says which torch to install
    assert got["devices: torch devices"].status == "fail" and "CUDA build of torch" in got["devices: torch devices"].fix





def _no_build(*args, **kwargs):
    raise AssertionError("the doctor started a build")


def test_doctor_never_builds_and_reports_the_build_state(tmp_path, monkeypatch, capsys):
    for name in ("build", "load", "_build", "_compile"):
        monkeypatch.setattr(extension, name, _no_build)
    monkeypatch.setattr(extension, "_state", {})
    cache = tmp_path / "cache"
    env = _env(tmp_path, TORCH_EXTENSIONS_DIR=str(cache))
    env.pop(extension.DISABLE_ENV, None)
    spec = extension.build_spec(env)

    def fused(env):
        return _by_name(doctor._fused_ops(env))

    got = fused(env)  # not built: said, with the command that builds; nothing created
    assert got["fused ops: extension"].status == "info" and "not built yet" in got["fused ops: extension"].detail
    assert "lightning-npu build-ops" in got["fused ops: extension"].detail and not cache.exists()
    no_cxx = fused({**env, "CXX": "no-such-compiler"})
    assert no_cxx["fused ops: C++ compiler"].status == "warn" and "install g++" in no_cxx["fused ops: C++ compiler"].fix
    assert no_cxx["fused ops: extension"].status == "warn" and "cannot be built here" in no_cxx["fused ops: extension"].detail
    disabled = fused({**env, extension.DISABLE_ENV: "1"})["fused ops: extension"]
    assert disabled.status == "info" and "disabled by LIGHTNING_NPU_NO_EXT" in disabled.detail

    extension._private_cache(spec.build_dir)  # a build that was killed: torch's lock and a dead owner
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    (spec.build_dir / build_lock.TORCH_LOCK).touch()
    (spec.build_dir / build_lock.OWNER).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                               "started": time.time() - 300}))
    lock = fused(env)["fused ops: build lock"]
    assert lock.status == "warn" and f"pid {dead.pid}" in lock.detail and "next build removes it" in lock.fix
    assert (spec.build_dir / build_lock.TORCH_LOCK).exists()  # reported, not touched

    fd = os.open(spec.build_dir / build_lock.OWNER, os.O_RDWR)  # a build running now (this process holds it)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        build_lock._record(fd)
        lock = fused(env)["fused ops: build lock"]
        assert lock.status == "info" and f"pid {os.getpid()}" in lock.detail and "waits for it" in lock.detail
    finally:
        os.close(fd)
    (spec.build_dir / build_lock.TORCH_LOCK).unlink()

    spec.library.write_bytes(b"")  # built for this torch, CPU and install
    got = fused(env)
    assert got["fused ops: extension"].status == "ok" and str(spec.library) in got["fused ops: extension"].detail
    assert "fused ops: build lock" not in got
    code = doctor.main(["--json"], env=env)  # the whole report, still without a build
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and any(c["name"] == "extension" and c["status"] == "ok" for c in report["checks"])

    cache.chmod(0o777)  # a cache others can write to is a hard failure, found without building
    unsafe = fused(env)["fused ops: extension"]
    assert unsafe.status == "fail" and "chmod go-w" in unsafe.fix
    cache.chmod(0o700)


def test_doctor_build_builds_first(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)
    monkeypatch.setattr(extension, "_state", {})
    calls = []

    def fake_compile(spec):
        calls.append(spec)
        spec.library.write_bytes(b"")
        return object()

    monkeypatch.setattr(extension, "_compile", fake_compile)
    monkeypatch.setattr(doctor, "_backend", lambda facts: doctor.Check("backend", "gloo", "ok", "skipped here"))
    assert doctor.main(["--build"], env=_env(tmp_path, TORCH_EXTENSIONS_DIR=str(cache))) == 0
    out, err = capsys.readouterr()
    assert len(calls) == 1 and "built the fused C++ kernels in" in err
    assert "fused ops: extension" in out and "(loaded)" in out and str(calls[0].library) in out


def test_compatibility_table():
    assert doctor.torch_npu_compatibility("2.1.0+cpu", "2.1.0.post8").status == "ok"
    bad = doctor.torch_npu_compatibility("2.4.0", "2.1.0.post3")
    assert bad.status == "fail" and "built for torch 2.1.0" in bad.detail and "pip install" in bad.fix
    assert doctor.torch_npu_compatibility("2.4.0", None).status == "info"
