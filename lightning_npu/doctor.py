"""`lightning-npu doctor`: is this machine ready to train? One table (or ``--json``), a fix per problem.

It reports the versions (Python, torch, lightning, torch_npu, the CANN toolkit, the NPU driver and firmware
through ``npu-smi``, the CUDA driver through ``nvidia-smi``) and checks: torch against torch_npu, the devices
(visible to torch, memory, temperature: warn at 85 C), the collective backend (a 1-process group does an
all-reduce), the ``HCCL_*`` environment (known variables with sane values; unknown ones flagged), RoCE links
through ``hccn_tool``, the C++ compiler and the fused-ops kernels, and free memory. Hard failures exit 1.

The doctor never compiles: it says whether the kernels are built for this torch, CPU and install, whether they could
be built here, and whether a build is running or left a stale lock, as DeepSpeed's ``ds_report`` does. ``--build``
builds them first (as ``lightning-npu build-ops`` does). A machine without an accelerator is fine: it exits 0 and says that lightning-npu
will train on CPU. Device facts come from `lightning_npu.device`; ``torch_npu`` is only imported there, lazily.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from lightning_npu import device
from lightning_npu.ops import extension

PROG = "lightning-npu doctor"
HOT_C = 85  # warn at this device temperature (the seed's threshold)
OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"

# torch_npu release -> the torch release it is built for (Ascend publishes one torch_npu per torch release;
# a .postN suffix is a patch of the same pairing). Unknown releases are checked by that rule.
TORCH_NPU_FOR_TORCH = {
    "2.1.0": "2.1.0", "2.2.0": "2.2.0", "2.3.1": "2.3.1", "2.4.0": "2.4.0", "2.5.1": "2.5.1",
    "2.6.0": "2.6.0", "2.7.1": "2.7.1", "2.8.0": "2.8.0",
}


@dataclass
class Check:
    section: str
    name: str
    status: str
    detail: str
    fix: str = ""


# ---- HCCL environment: the variables CANN documents, each with a sanity check ------------------------------------
def _int_in(lo: int, hi: int) -> Callable[[str], Optional[str]]:
    def check(value: str) -> Optional[str]:
        if not re.fullmatch(r"-?\d+", value.strip()):
            return f"must be an integer in [{lo}, {hi}]"
        return None if lo <= int(value) <= hi else f"must be in [{lo}, {hi}]"

    return check


def _one_of(*choices: str) -> Callable[[str], Optional[str]]:
    return lambda value: None if value.strip() in choices else f"must be one of {', '.join(choices)}"


def _ip(value: str) -> Optional[str]:
    try:
        ipaddress.ip_address(value.strip())
        return None
    except ValueError:
        return "must be an IPv4 or IPv6 address of this host"


def _port_range(value: str) -> Optional[str]:
    ok = all(re.fullmatch(r"\d+(-\d+)?|auto", part.strip()) for part in value.split(","))
    return None if ok else "must be 'auto' or ports/ranges such as 60000-60050"


def _anything(value: str) -> Optional[str]:
    return None if value.strip() else "is empty"


_FLAG = _one_of("0", "1")
HCCL_VARIABLES: dict[str, Callable[[str], Optional[str]]] = {
    "HCCL_CONNECT_TIMEOUT": _int_in(120, 7200),  # seconds, default 120
    "HCCL_EXEC_TIMEOUT": _int_in(0, 2147483647),  # seconds; 0 = no timeout (the upper bound depends on the product)
    "HCCL_BUFFSIZE": _int_in(1, 1 << 20),  # MB per communicator buffer, default 200
    "HCCL_ALGO": _anything,
    "HCCL_INTRA_PCIE_ENABLE": _FLAG,
    "HCCL_INTRA_ROCE_ENABLE": _FLAG,
    "HCCL_INTER_HCCS_DISABLE": _one_of("TRUE", "FALSE", "true", "false"),
    "HCCL_OP_EXPANSION_MODE": _one_of("AI_CPU", "AIV", "HOST", "CCU_MS", "CCU_SCHED"),
    "HCCL_DETERMINISTIC": _one_of("true", "false", "TRUE", "FALSE", "strict", "STRICT"),
    "HCCL_LOGIC_SUPERPOD_ID": _anything,
    "HCCL_IF_IP": _ip,
    "HCCL_IF_BASE_PORT": _int_in(1024, 65520),
    "HCCL_HOST_SOCKET_PORT_RANGE": _port_range,
    "HCCL_NPU_SOCKET_PORT_RANGE": _port_range,
    "HCCL_SOCKET_IFNAME": _anything,
    "HCCL_SOCKET_FAMILY": _one_of("AF_INET", "AF_INET6"),
    "HCCL_RDMA_TC": _int_in(0, 255),
    "HCCL_RDMA_SL": _int_in(0, 7),
    "HCCL_RDMA_TIMEOUT": _int_in(5, 20),
    "HCCL_RDMA_RETRY_CNT": _int_in(1, 7),
    "HCCL_RDMA_PCIE_DIRECT_POST_NOSTRICT": _one_of("TRUE", "FALSE", "true", "false"),
    "HCCL_RDMA_QPS_PER_CONNECTION": _int_in(1, 32),
    "HCCL_RDMA_QP_PORT_CONFIG_PATH": _anything,
    "HCCL_MULTI_QP_THRESHOLD": _int_in(1, 8192),
    "HCCL_WHITELIST_DISABLE": _FLAG,
    "HCCL_WHITELIST_FILE": _anything,
    "HCCL_DIAGNOSE_ENABLE": _FLAG,
    "HCCL_ENTRY_LOG_ENABLE": _FLAG,
    "HCCL_DEBUG_CONFIG": _anything,
    "HCCL_DFS_CONFIG": _anything,
    "HCCL_OP_RETRY_ENABLE": _anything,
    "HCCL_OP_RETRY_PARAMS": _anything,
}
# names that circulate in guides but that HCCL does not read: setting them changes nothing
NOT_HCCL = {
    "HCCL_GROUP_SIZE": "HCCL has no group-size variable: the communicator size comes from the process group",
    "HCCL_LARGE_BUFFER": "HCCL has no large-buffer switch: the buffer size is HCCL_BUFFSIZE (MB)",
}


def check_hccl_env(env: Mapping[str, str]) -> list[Check]:
    out = []
    for name in sorted(k for k in env if k.startswith("HCCL_")):
        value = env[name]
        if name in NOT_HCCL:
            out.append(Check("hccl", name, WARN, f"={value}: does not exist; {NOT_HCCL[name]}", f"unset {name}"))
        elif name not in HCCL_VARIABLES:
            out.append(Check("hccl", name, WARN, f"={value}: not a documented HCCL variable (a typo?)",
                             f"unset {name}, or check its name in the CANN HCCL environment variable reference"))
        else:
            problem = HCCL_VARIABLES[name](value)
            out.append(Check("hccl", name, WARN if problem else OK, f"={value}" + (f": {problem}" if problem else ""),
                             f"export {name}=<a value that {problem}>" if problem else ""))
    return out


# ---- external tools --------------------------------------------------------------------------------------------
def _run(cmd: list[str], env: Mapping[str, str], timeout: float = 15) -> Optional[str]:
    exe = shutil.which(cmd[0], path=env.get("PATH"))
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *cmd[1:]], env=dict(env), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_npu_smi(text: str) -> dict[str, Any]:
    """`npu-smi info`: its version and, per NPU, name, health, temperature (C) and HBM used/total (MB)."""
    version = re.search(r"Version:\s*([\w.\-]+)", text)
    devices = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\|\s*(\d+)\s+(\S+)\s*\|\s*(\w+)\s*\|\s*([\d.]+|-)\s+(\d+)", line)
        if not m:
            continue
        dev: dict[str, Any] = {"id": int(m[1]), "name": m[2], "health": m[3], "temperature_c": int(m[5])}
        if i + 1 < len(lines):
            usage = re.findall(r"(\d+)\s*/\s*(\d+)", lines[i + 1])
            if usage:
                used, total = usage[-1]
                dev.update(memory_used_mb=int(used), memory_total_mb=int(total))
        devices.append(dev)
    return {"version": version[1] if version else None, "devices": devices}


def parse_board_info(text: str) -> dict[str, str]:
    """`npu-smi info -t board -i N`: the driver (Software Version) and firmware versions."""
    out = {}
    for key, label in (("driver", "Software Version"), ("firmware", "Firmware Version")):
        m = re.search(rf"{label}\s*:\s*(\S+)", text)
        if m:
            out[key] = m[1]
    return out


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.free,temperature.gpu --format=csv,...`"""
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 6 and parts[0].isdigit():
            out.append({"id": int(parts[0]), "name": parts[1], "driver": parts[2],
                        "memory_total_mb": int(float(parts[3])), "memory_free_mb": int(float(parts[4])),
                        "temperature_c": int(float(parts[5]))})
    return out


def cann_version(env: Mapping[str, str]) -> tuple[Optional[str], Optional[Path]]:
    """The CANN toolkit version from its install info under ASCEND_TOOLKIT_HOME or /usr/local/Ascend."""
    roots = [env.get("ASCEND_TOOLKIT_HOME"), "/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend"]
    for root in filter(None, roots):
        base = Path(root)
        if not base.is_dir():
            continue
        for info in [base / "ascend_toolkit_install.info", *sorted(base.glob("*/ascend_toolkit_install.info")),
                     *sorted(base.glob("ascend-toolkit/latest/*/ascend_toolkit_install.info"))]:
            if info.is_file():
                m = re.search(r"^version=(\S+)", info.read_text(errors="replace"), re.M)
                if m:
                    return m[1], base
        return None, base
    return None, None


def torch_npu_compatibility(torch_version: str, torch_npu_version: Optional[str]) -> Check:
    if torch_npu_version is None:
        return Check("compatibility", "torch / torch_npu", INFO, "torch_npu not installed (needed only for NPUs)")
    base = lambda v: (re.match(r"\d+\.\d+(\.\d+)?", v) or re.match(".*", v))[0]  # noqa: E731
    t, n = base(torch_version), base(torch_npu_version)
    want = TORCH_NPU_FOR_TORCH.get(n, n)
    if t == want:
        return Check("compatibility", "torch / torch_npu", OK,
                     f"torch {torch_version} with torch_npu {torch_npu_version}")
    return Check("compatibility", "torch / torch_npu", FAIL,
                 f"torch_npu {torch_npu_version} is built for torch {want}, but torch is {torch_version}",
                 f"pip install torch=={want} (or the torch_npu release for torch {t}: pip install torch-npu=={t}.*)")


def _version(dist: str) -> Optional[str]:
    for name in (dist, dist.replace("_", "-")):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# ---- the checks ----------------------------------------------------------------------------------------------------
def _versions(env: Mapping[str, str]) -> tuple[list[Check], dict[str, Any]]:
    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "lightning": _version("lightning"),
             "torch_npu": _version("torch_npu")}
    out = [Check("versions", k, INFO, v or "not installed") for k, v in facts.items()]
    cann, where = cann_version(env)
    facts["cann"] = cann
    out.append(Check("versions", "CANN toolkit", INFO, f"{cann} ({where})" if cann else
                     (f"no install info under {where}" if where else "not found (needed only for NPUs)")))
    out.append(torch_npu_compatibility(torch.__version__, facts["torch_npu"]))
    return out, facts


def _npu_tools(env: Mapping[str, str], facts: dict[str, Any]) -> list[Check]:
    out: list[Check] = []
    text = _run(["npu-smi", "info"], env)
    if text is None:
        return out
    info = parse_npu_smi(text)
    facts["npu_smi"] = info
    board = parse_board_info(_run(["npu-smi", "info", "-t", "board", "-i", str(info["devices"][0]["id"])], env) or "") \
        if info["devices"] else {}
    facts.update({f"npu_{k}": v for k, v in board.items()})
    out.append(Check("versions", "NPU driver", INFO, board.get("driver") or info["version"] or "unknown"))
    out.append(Check("versions", "NPU firmware", INFO, board.get("firmware") or "unknown (npu-smi info -t board)"))
    for dev in info["devices"]:
        mem = (f", HBM {dev['memory_used_mb']}/{dev['memory_total_mb']} MB used" if "memory_total_mb" in dev else "")
        detail = f"{dev['name']} health {dev['health']}, {dev['temperature_c']} C{mem}"
        status, fix = OK, ""
        if dev["health"].upper() not in ("OK",):
            status, fix = FAIL, f"npu-smi reports health {dev['health']}: see `npu-smi info -t health -i {dev['id']}`"
        elif dev["temperature_c"] >= HOT_C:
            status, fix = WARN, f"at or above {HOT_C} C: check cooling/airflow before a long run"
        out.append(Check("devices", f"npu {dev['id']}", status, detail, fix))
    if not facts.get("cann"):
        out.append(Check("versions", "CANN toolkit", FAIL, "npu-smi sees NPUs but no CANN toolkit was found",
                         "install the CANN toolkit and `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
                         "(or set ASCEND_TOOLKIT_HOME)"))
    return out


def _cuda_tools(env: Mapping[str, str], facts: dict[str, Any]) -> list[Check]:
    text = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,memory.free,temperature.gpu",
                 "--format=csv,noheader,nounits"], env)
    if text is None:
        return []
    gpus = parse_nvidia_smi(text)
    facts["nvidia_smi"] = gpus
    out = [Check("versions", "CUDA driver", INFO, gpus[0]["driver"] if gpus else "unknown")]
    for gpu in gpus:
        hot = gpu["temperature_c"] >= HOT_C
        out.append(Check("devices", f"gpu {gpu['id']}", WARN if hot else OK,
                         f"{gpu['name']}, {gpu['temperature_c']} C, "
                         f"{gpu['memory_free_mb']}/{gpu['memory_total_mb']} MB free", f"at or above {HOT_C} C: check cooling/airflow before a long run" if hot else ""))
    return out


def _torch_devices(facts: dict[str, Any]) -> list[Check]:
    import torch

    try:
        kind = device.accelerator_type()
    except Exception as err:  # a broken torch_npu install
        kind = device.CPU
        facts["accelerator_error"] = str(err)
    facts["accelerator"] = kind
    out = []
    seen_npus = len((facts.get("npu_smi") or {}).get("devices", []))
    seen_gpus = len(facts.get("nvidia_smi") or [])
    if kind == device.CPU:
        if seen_npus:
            fix = ("pip install torch-npu matching torch " + torch.__version__.split("+")[0] +
                   " and `source <CANN>/set_env.sh`") if not facts.get("torch_npu") else \
                "source the CANN set_env.sh and check ASCEND_RT_VISIBLE_DEVICES"
            out.append(Check("devices", "torch devices", FAIL,
                             f"npu-smi sees {seen_npus} NPU(s) but torch cannot use them"
                             + (f" ({facts['accelerator_error']})" if "accelerator_error" in facts else ""), fix))
        elif seen_gpus:
            out.append(Check("devices", "torch devices", FAIL,
                             f"nvidia-smi sees {seen_gpus} GPU(s) but this torch ({torch.__version__}) cannot use them",
                             "install a CUDA build of torch (https://pytorch.org/get-started/locally/) and check "
                             "CUDA_VISIBLE_DEVICES"))
        else:
            out.append(Check("devices", "accelerator", INFO,
                             "no accelerator: lightning-npu will train on CPU (gloo), which is fine for the examples"))
        return out
    count = device.device_count(kind)
    out.append(Check("devices", "torch devices", OK if count else FAIL, f"{count} {kind} device(s) visible to torch",
                     "" if count else f"check {kind.upper()}_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES"))
    for i in range(count):
        stats = device.memory_stats(torch.device(kind, i))
        if "total_bytes" in stats:
            out.append(Check("memory", f"{kind}:{i}", OK, f"{stats['free_bytes'] / 1e9:.1f} of "
                             f"{stats['total_bytes'] / 1e9:.1f} GB free"))
    return out


def _backend(facts: dict[str, Any]) -> Check:
    """A 1-process group of the device's backend does one all-reduce."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    kind = facts.get("accelerator", device.CPU)
    try:
        backend = device.comm_backend(kind)
    except Exception as err:
        return Check("backend", "collectives", FAIL, str(err), "pass process_group_backend=... to NPUHybridStrategy")
    if dist.is_initialized():
        return Check("backend", backend, INFO, "a process group already exists in this process; not re-tested")
    try:
        if kind != device.CPU:
            device.set_device(torch.device(kind, 0))
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
        t = torch.ones(4, device=torch.device(kind, 0) if kind != device.CPU else "cpu")
        dist.all_reduce(t)
        device.synchronize(t.device)
        ok = bool((t == 1).all())
        dist.destroy_process_group()
    except Exception as err:
        if dist.is_initialized():
            dist.destroy_process_group()
        return Check("backend", backend, FAIL, f"1-process {backend} group failed: {str(err).splitlines()[0]}",
                     "hccl: source the CANN set_env.sh; nccl: check the driver; see the error above")
    return Check("backend", backend, OK if ok else FAIL, f"1-process {backend} all-reduce on {kind}",
                 "" if ok else "the all-reduce returned a wrong value: check the driver/toolkit install")


def _rdma(env: Mapping[str, str], facts: dict[str, Any]) -> list[Check]:
    devices = [d["id"] for d in (facts.get("npu_smi") or {}).get("devices", [])]
    if not devices:
        return []
    if shutil.which("hccn_tool", path=env.get("PATH")) is None:
        return [Check("rdma", "hccn_tool", INFO, "not found: RoCE links not checked (one node needs none)")]
    out = []
    for i in devices:
        link = _run(["hccn_tool", "-i", str(i), "-link", "-g"], env) or ""
        ip = _run(["hccn_tool", "-i", str(i), "-ip", "-g"], env) or ""
        state = re.search(r"link status:\s*(\w+)", link, re.I)
        addr = re.search(r"ipaddr:\s*(\S+)", ip, re.I)
        up = bool(state and state[1].upper() == "UP")
        detail = f"link {state[1] if state else 'unknown'}, ip {addr[1] if addr else 'none'}"
        fix = "" if up and addr else (f"multi-node runs need it: check the cable/switch and `hccn_tool -i {i} -link -g`"
                                      + ("" if addr else f"; set an address with `hccn_tool -i {i} -ip -s ...`"))
        out.append(Check("rdma", f"roce {i}", OK if up and addr else WARN, detail, fix))
    return out


def _fused_ops(env: Mapping[str, str], build: bool = False) -> list[Check]:
    """The compiler and the kernels' build state, from `extension.status` (nothing is compiled unless `build`)."""
    cxx = env.get("CXX", "c++")
    found = shutil.which(cxx, path=env.get("PATH"))
    out = [Check("fused ops", "C++ compiler", OK if found else WARN, found or f"{cxx!r} not on PATH",
                 "" if found else "install g++ (e.g. apt-get install g++) for the fused CPU kernels; "
                 "without it fuse_ops=True uses eager fallbacks")]
    failed = None
    if build:
        try:
            extension.build()  # prints its own start and end lines
        except extension.UnsafeCacheError:
            pass  # reported below, from the status
        except Exception as err:
            failed = (str(err).strip().splitlines() or [type(err).__name__])[0]
    try:
        st = extension.status(env)
    except extension.UnsafeCacheError as err:
        out.append(Check("fused ops", "extension", FAIL, str(err).splitlines()[0],
                         f"chmod go-w {extension.cache_dir(env)} (or set TORCH_EXTENSIONS_DIR to a private directory)"))
        return out
    out.append(_kernels_check(st, failed))
    if st.lock.in_progress:
        who = st.lock.building.describe() if st.lock.building else "an unrecorded process"
        out.append(Check("fused ops", "build lock", INFO, f"a build is running ({who}): fuse_ops=True waits for it"))
    elif st.lock.stale:
        out.append(Check("fused ops", "build lock", WARN, f"stale lock in {st.spec.build_dir} ({st.lock.stale})",
                         "nothing to do: the next build removes it (lightning-npu build-ops)"))
    return out


def _kernels_check(st: extension.Status, failed: Optional[str]) -> Check:
    import torch

    others = (f"; {len(st.others)} other build(s) in the cache are for other torch versions, sources, flags or "
              "installs" if st.others else "")
    if st.spec is not None and (st.loaded or st.built):
        return Check("fused ops", "extension", OK, f"built for torch {torch.__version__}, {st.spec.simd}, this "
                     f"install{' (loaded)' if st.loaded else ''}: {st.spec.library}")
    if failed or st.error:
        return Check("fused ops", "extension", WARN, f"the build failed: {failed or st.error}",
                     "fuse_ops=True uses eager fallbacks; LIGHTNING_NPU_VERBOSE_BUILD=1 lightning-npu build-ops shows "
                     "the compiler's output")
    if st.problem and st.problem.startswith("disabled"):
        return Check("fused ops", "extension", INFO, f"{st.problem}: fuse_ops=True uses eager fallbacks")
    if st.problem:
        return Check("fused ops", "extension", WARN, f"not built, and cannot be built here: {st.problem}",
                     "fuse_ops=True uses eager fallbacks; see the other fused-ops lines for what is missing")
    return Check("fused ops", "extension", INFO,
                 f"not built yet for torch {torch.__version__}, {st.spec.simd}, this install ({st.spec.build_dir}): "
                 f"the first fuse_ops=True run compiles it (a few minutes); `lightning-npu build-ops` (or `doctor "
                 f"--build`) builds it now{others}")


def _host_memory() -> Check:
    try:
        text = Path("/proc/meminfo").read_text()
        avail = int(re.search(r"MemAvailable:\s*(\d+)", text)[1]) * 1024
        total = int(re.search(r"MemTotal:\s*(\d+)", text)[1]) * 1024
    except (OSError, TypeError):
        return Check("memory", "host", INFO, "unknown (no /proc/meminfo)")
    low = avail < 4e9
    return Check("memory", "host", WARN if low else OK, f"{avail / 1e9:.1f} of {total / 1e9:.1f} GB available",
                 "less than 4 GB free: close other jobs or lower the batch size / workers" if low else "")


def collect(env: Optional[Mapping[str, str]] = None, skip: tuple[str, ...] = (),
            build: bool = False) -> tuple[list[Check], dict[str, Any]]:
    """Every check, in report order, and the facts found. `skip` names sections not to run ("backend",
    "fused ops"); `build` builds the fused kernels first (never otherwise)."""
    env = dict(os.environ if env is None else env)
    checks, facts = _versions(env)
    checks += _npu_tools(env, facts)
    checks += _cuda_tools(env, facts)
    checks += _torch_devices(facts)
    if "backend" not in skip:
        checks.append(_backend(facts))
    checks += check_hccl_env(env)
    checks += _rdma(env, facts)
    if "fused ops" not in skip:
        checks += _fused_ops(env, build=build)
    checks.append(_host_memory())
    return checks, facts


def render(checks: list[Check], facts: dict[str, Any]) -> str:
    mark = {OK: "ok", INFO: "--", WARN: "WARN", FAIL: "FAIL"}
    width = max(len(f"{c.section}: {c.name}") for c in checks)
    lines = [f"{mark[c.status]:>4}  {f'{c.section}: {c.name}':<{width}}  {c.detail}" for c in checks]
    fixes = [f"  {c.section}: {c.name}: {c.fix}" for c in checks if c.fix and c.status in (WARN, FAIL)]
    if fixes:
        lines += ["", "fixes:", *fixes]
    failed = sum(c.status == FAIL for c in checks)
    where = facts.get("accelerator", "cpu")
    lines.append("")
    lines.append(f"{failed} hard failure(s): not ready." if failed else
                 f"ready: lightning-npu will train on {'CPU' if where == 'cpu' else where.upper()}.")
    return "\n".join(lines)


def main(args: Optional[list[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="the same report as JSON")
    parser.add_argument("--build", action="store_true",
                        help="build the fused C++ kernels first, if they are not built (without it nothing is compiled)")
    opts = parser.parse_args(args)
    checks, facts = collect(env, build=opts.build)
    failed = any(c.status == FAIL for c in checks)
    if opts.json:
        print(json.dumps({"ready": not failed, "accelerator": facts.get("accelerator"), "facts": facts,
                          "checks": [asdict(c) for c in checks]}, indent=2, default=str))
    else:
        print(render(checks, facts))
    return 1 if failed else 0


def command(args: list[str]) -> None:
    """`COMMANDS` entry of `lightning_npu.cli`."""
    code = main(args)
    sys.stdout.flush()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    command(sys.argv[1:])
