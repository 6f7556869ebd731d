"""Run documentation snippets as scripts, each in a fresh forked child of this one interpreter.

Importing Lightning costs seconds per process; forking after the import (and before any thread pool or
process group exists) gives every snippet a fresh process for free. A snippet that asks for
``devices=N`` (N > 1) runs as N ranks with torchrun's environment, which Lightning treats as an external
launch, as `lightning_npu.launch.spawn` does. Usage: ``python _docs_runner.py SNIPPETS.json`` where the file
lists ``{"id", "code", "cwd"}``; prints one JSON line per snippet: ``{"id", "ok", "output"}``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback
import types

import lightning  # noqa: F401  (the expensive imports, shared by every fork)
import torch  # noqa: F401

import lightning_npu  # noqa: F401
from lightning_npu.launch import free_port

TIMEOUT_S = 150


def _rank(code: str, cwd: str, env: dict[str, str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    os.environ.update(env)
    path = os.path.join(cwd, "snippet.py")
    with open(path, "w") as f:
        f.write(code)
    sys.argv = [path]
    main = types.ModuleType("__main__")
    main.__file__ = path
    sys.modules["__main__"] = main  # classes the snippet defines pickle as a script's would
    status = 0
    try:
        exec(compile(code, path, "exec"), main.__dict__)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter teardown: gloo can abort while destroying process groups at exit


def ranks(code: str) -> int:
    """The processes a snippet runs as: the largest ``devices=N`` that a ``Trainer(...)`` call passes. Comments and
    other calls (the planner's ``ClusterSpec(devices=64)`` describes a cluster, it trains nothing) launch none."""
    code = re.sub(r"#[^\n]*", "", code)
    counts = [1]
    for m in re.finditer(r"\bTrainer\(", code):
        depth, end = 1, m.end()
        while end < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            end += 1
        counts += [int(n) for n in re.findall(r"\bdevices=(\d+)", code[m.end():end])]
    return max(counts)


def run(code: str, cwd: str) -> tuple[bool, str]:
    nprocs = ranks(code)
    port = free_port()
    log = os.path.join(cwd, "snippet.log")
    pids = []
    for rank in range(nprocs):
        env = {} if nprocs == 1 else dict(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs), RANK=str(rank),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", NODE_RANK="0",
        )
        pid = os.fork()
        if pid == 0:
            _rank(code, cwd, env, log)
        pids.append(pid)
    deadline, codes = time.monotonic() + TIMEOUT_S, {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(c != 0 for c in codes.values())
        if failed or time.monotonic() > deadline:  # a lone rank would wait in a collective forever
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[pid] = -9
        time.sleep(0.05)
    with open(log) as f:
        output = f.read()
    ok = all(c == 0 for c in codes.values())
    if not ok and time.monotonic() > deadline:
        output += f"\n(timed out after {TIMEOUT_S} s)"
    return ok, output


if __name__ == "__main__":
    for item in json.load(open(sys.argv[1])):
        ok, output = run(item["code"], item["cwd"])
        print(json.dumps({"id": item["id"], "ok": ok, "output": output[-6000:]}), flush=True)
