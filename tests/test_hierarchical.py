"""Hierarchical all-reduce (`lightning_npu.parallel.data_parallel.hierarchical`): parity with the flat all-reduce on 2 nodes x 2
processes (two torchrun launches on this machine), and its errors."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.config import ParallelConfig, ParallelConfigError
from lightning_npu.parallel.data_parallel import hierarchical

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hierarchical_equals_flat_two_nodes(tmp_path):
    out, port = tmp_path / "result", _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
         "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "tests._torchrun_hierarchical", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]
    for r in ranks:
        assert r["nodes"] == [0, 0, 1, 1] and r["local"] == 2 and r["spans"] == 2
        # 9 MiB >= the "auto" threshold: the three-stage path ran, and it sums as the flat all-reduce does
        assert r["9mb"]["hier"] == 1 and r["9mb"]["close"] and r["9mb"]["changed"] > 1
        # 1 MiB < 8 MiB: "auto" keeps the flat all-reduce (bit-identical to it)
        assert r["1mb"]["hier"] == 0 and r["1mb"]["max_abs"] == 0.0 and r["1mb"]["changed"] > 1
        # True, 1001 elements (not a multiple of the 2 ranks per node): the padded path
        assert r["odd"]["hier"] == 1 and r["odd"]["close"]
        # Trainer(num_nodes=2), zero 0: DDP's comm hook went hierarchical on every step, and the losses match flat
        assert r["hier_buckets"] >= 4 and r["flat_buckets"] == -1
        assert r["losses_hier"] == pytest.approx(r["losses_flat"], rel=1e-5, abs=0)


def test_hierarchical_allreduce_bad_values():
    for bad in ("yes", 1, 0, None, "true"):
        with pytest.raises(ParallelConfigError, match="hierarchical_allreduce"):
            ParallelConfig(hierarchical_allreduce=bad)
    with pytest.raises(ParallelConfigError, match="zero_stage=0"):
        NPUHybridStrategy(zero_stage=1, hierarchical_allreduce=True)
    ParallelConfig(zero_stage=0, hierarchical_allreduce=True)  # accepted; the node count is checked at setup
    with pytest.raises(ParallelConfigError, match="hierarchical_allreduce=True.*choose one"):
        ParallelConfig(zero_stage=0, hierarchical_allreduce=True, gradient_compression="int8")
    ParallelConfig(zero_stage=0, gradient_compression="int8")  # "auto" leaves compressed buckets flat


class _Mesh:
    """A ("pp", "dp", "tp") rank layout, as DeviceMesh.mesh holds it (build_hierarchy reads no more than that)."""

    def __init__(self, pp: int, dp: int, tp: int) -> None:
        self.mesh = torch.arange(pp * dp * tp).reshape(pp, dp, tp)


def test_hierarchy_refuses_layouts_without_an_inter_node_stage():
    # pp=2 x dp=2 on 2 nodes of 2: each dp group lies in one node
    assert hierarchical.build_hierarchy(_Mesh(2, 2, 1), "auto", [0, 0, 1, 1]) is None
    with pytest.raises(ParallelConfigError, match="inside one node"):
        hierarchical.build_hierarchy(_Mesh(2, 2, 1), True, [0, 0, 1, 1])
    # dp=3 over nodes of 2 and 1 ranks
    with pytest.raises(ParallelConfigError, match="split evenly"):
        hierarchical.build_hierarchy(_Mesh(1, 3, 1), True, [0, 0, 1])
    assert hierarchical.build_hierarchy(_Mesh(1, 4, 1), False, [0, 0, 1, 1]) is None
    # tp=2 per node: one dp rank per node, nothing for "auto" to gain
    assert hierarchical.build_hierarchy(_Mesh(1, 2, 2), "auto", [0, 0, 1, 1]) is None
    assert hierarchical.dp_rank_lists(_Mesh(2, 2, 2)) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_hierarchical_true_on_one_node_fails_clearly():
    with pytest.raises(ParallelConfigError, match="more than one node"):
        hierarchical.setup_hierarchy(type("M", (), {"mesh": torch.zeros(1, 1, 1)})(), True, 0, 1, 0, "cpu", 25.0)


def test_hccl_group_options_size_the_buffer_to_a_bucket(monkeypatch):
    """On NPU the hierarchy's groups get torch_npu's per-group HCCL options (a stand-in module here: no NPU)."""
    import types

    from lightning_npu import device as dev

    class Options:
        hccl_config: dict = {}

    fake = types.ModuleType("torch_npu")
    fake._C = types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(
        ProcessGroupHCCL=types.SimpleNamespace(Options=Options)))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    assert dev.group_options("npu", 25.0).hccl_config == {"hccl_buffer_size": 25}
    assert dev.group_options("npu", 0.5).hccl_config == {"hccl_buffer_size": 1}
    assert dev.group_options("npu", 7.2).hccl_config == {"hccl_buffer_size": 8}
    assert dev.group_options("cpu", 25.0) is None and dev.group_options("cuda", 25.0) is None
