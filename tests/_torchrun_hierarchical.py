"""Run under two torchrun launches (2 nodes x 2 processes): hierarchical all-reduce == flat, raw and in a Trainer."""

import json
import os
import sys

import lightning as L
import torch
import torch.distributed as dist

import lightning_npu  # noqa: F401
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.data_parallel import hierarchical
from lightning_npu.parallel.data_parallel.sync import reduce_bucket
from lightning_npu.parallel.mesh import build_mesh
from tests._gpt_workers import SMALL_GPT, LossRecorder


def raw_collectives(result: dict) -> None:
    """9 MiB and 1 MiB buckets through `reduce_bucket` with the "auto" hierarchy vs a plain all-reduce."""
    mesh = build_mesh("cpu", 1, 4, 1)
    group = mesh["dp"].get_group()
    nodes = hierarchical.gather_node_ranks(int(os.environ["GROUP_RANK"]))
    result["nodes"] = nodes
    auto = hierarchical.build_hierarchy(mesh, "auto", nodes)
    forced = hierarchical.build_hierarchy(mesh, True, nodes)
    result["local"], result["spans"] = auto.local, auto.nodes
    gen = torch.Generator().manual_seed(dist.get_rank())
    for name, numel, h in (("9mb", 9 * 2**18, auto), ("1mb", 2**18, auto), ("odd", 1001, forced)):
        x = torch.randn(numel, generator=gen)
        flat = x.clone()
        dist.all_reduce(flat, group=group)
        before = h.launched
        got = x.clone()
        reduce_bucket(got, group, hierarchy=h).wait()
        result[name] = {"hier": h.launched - before, "close": torch.allclose(got, flat, rtol=1e-6, atol=1e-6),
                        "max_abs": float((got - flat).abs().max()), "changed": float((got - x).abs().max())}


def trainer_losses(hier: bool) -> tuple[list[float], int]:
    L.seed_everything(0, verbose=False)
    model = GPTModule(**SMALL_GPT)
    data = TextDataModule(block_size=32, batch_size=2, shuffle=False)
    rec = LossRecorder()
    strategy = NPUHybridStrategy(zero_stage=0, hierarchical_allreduce=hier)
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[rec], deterministic=True, precision="32-true")
    trainer.fit(model, datamodule=data)
    h = trainer.strategy.hierarchy
    return rec.local, (h.launched if h is not None else -1)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    result: dict = {"rank": dist.get_rank()}
    raw_collectives(result)
    result["losses_hier"], result["hier_buckets"] = trainer_losses(True)
    result["losses_flat"], result["flat_buckets"] = trainer_losses(False)
    with open(f"{out_path}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
