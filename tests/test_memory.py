"""Memory accounting (`lightning_npu.memory`, `MemoryMonitor`): exact bytes per rank by kind."""

from __future__ import annotations

import copy
import logging
import math

import lightning as L
import pytest
import torch

from examples.gpt.model import GPT, GPTConfig, GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import MemoryMonitor
from lightning_npu.launch import spawn
from lightning_npu.memory import SavedActivations, storage_keys
from lightning_npu.parallel.recompute import apply_activation_checkpointing
from tests._gpt_workers import SMALL_GPT, parity_trainer

N_LAYER = 4


def _saved(module: torch.nn.Module, fn) -> int:
    with SavedActivations(storage_keys(module.parameters())) as meter:
        fn()
    return meter.peak


def test_full_recompute_keeps_only_block_inputs():
    """saved(full) = saved(none) - n_blocks x (what one block saves besides its input), measured block by block."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=N_LAYER, n_head=4, n_embd=64, dropout=0.1))
    x = torch.randint(0, 64, (4, 64))
    saved = {}
    for policy in (None, 2, "selective", "full"):
        m = copy.deepcopy(model)
        if policy is not None:
            apply_activation_checkpointing(m, policy)
        saved[policy] = _saved(m, lambda: m(x))
    block = copy.deepcopy(model.transformer.h[0])
    h = torch.randn(4, 64, 64, requires_grad=True) * 1.0  # a non-leaf input, as inside the model
    inside = _saved(block, lambda: block(h)) - h.numel() * h.element_size()
    predicted = saved[None] - N_LAYER * inside
    assert abs(saved["full"] / predicted - 1) < 0.10, (saved, inside, predicted)
    assert saved["full"] < saved["selective"] < saved[None]  # selective keeps the matmul outputs
    assert abs(saved[2] / (saved[None] - N_LAYER // 2 * inside) - 1) < 0.10


def test_meter_frees_a_graph_dropped_without_backward():
    """A saved output (SDPA saves its own) must not tie the graph to the meter: dropped, it is freed and uncounted.

    The pipeline's shape inference drops stage 0's first forward this way; the meter once kept it alive for the run.
    """
    import gc
    import weakref

    q = torch.randn(2, 4, 16, 8, requires_grad=True) * 1.0
    with SavedActivations() as meter:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        alive = weakref.ref(out)
        assert meter.current > 0
        del out
        gc.collect()
        assert alive() is None and meter.current == 0
        grad = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum(), q)
        assert meter.current == 0 and meter.peak > 0  # backward released what it used
    want = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum(), q)
    assert torch.equal(grad[0], want[0])  # and it got the tensors the meter packed


def test_bad_arguments():
    with pytest.raises(TypeError, match="activations"):
        MemoryMonitor(activations="yes")
    with pytest.raises((TypeError, ValueError), match="log_every_n_steps"):
        MemoryMonitor(log_every_n_steps=0)


def _fit(zero_stage: int, devices: int) -> dict:
    L.seed_everything(0, verbose=False)
    model = GPTModule(**SMALL_GPT)
    monitor = MemoryMonitor()
    trainer, data = parity_trainer(NPUHybridStrategy(zero_stage=zero_stage), model, devices, 8, 2, [monitor],
                                   log_every_n_steps=1)
    trainer.fit(model, datamodule=data)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("memory/")}
    return {"last": dict(monitor.last), "logged": logged, "summary": monitor.last_summary,
            "shapes": [tuple(p.shape) for p in GPTModule(**SMALL_GPT).parameters()]}


def _stages() -> list:
    return [_fit(zero, 2) for zero in (0, 1, 2, 3)]


def test_bytes_per_rank_by_zero_stage(caplog):
    """dp=2 on gloo, at a step's end: ZeRO 1 halves the optimizer state, 2 also the gradients (and FSDP2 has resharded the
    parameters, which zero 2 keeps whole only from forward to backward), 3 the parameters; activations stay."""
    with caplog.at_level(logging.INFO):
        single = spawn(_fit, 1, 0, 1)[0]
    assert "memory per rank, MiB: params" in single["summary"]
    for rank, runs in enumerate(spawn(_stages, 2)):
        shapes = runs[0]["shapes"]
        full = sum(math.prod(s) for s in shapes) * 4
        half = sum(math.ceil(s[0] / 2) * math.prod(s[1:]) for s in shapes) * 4  # Shard(0) rows, padded
        steps = 4 * len(shapes)  # AdamW's per-parameter `step` counters (fp32 scalars)
        expected = {
            0: (full, full, 2 * full + steps),
            # + the fp32 master slices; on gloo the gradients stay whole in the in-place bucket buffer (one
            # all-to-all into this rank's rows: gloo's reduce-scatter is slower), the reduce-scatter backends keep half
            1: (full, full, 2 * half + half + steps),
            2: (half, half, 2 * half + steps),  # between steps FSDP2 holds only the shards (zero 2 unshards once)
            3: (half, half, 2 * half + steps),
        }
        for zero, run in enumerate(runs):
            got = tuple(int(run["last"][k]) for k in ("parameters", "gradients", "optimizer_state"))
            assert got == expected[zero], f"rank {rank} zero {zero}: {got} != {expected[zero]}"
            assert run["logged"]["memory/parameters_bytes"] == run["last"]["parameters"]
            assert "memory/rss_bytes" in run["logged"]  # CPU: the process's RSS, no allocator figures
            # each dp rank runs half the global batch: half the activations of the one-process run
            ratio = run["last"]["activations_peak"] / single["last"]["activations_peak"]
            assert 0.45 < ratio < 0.55, (zero, ratio)


def test_allocator_defaults_only_where_unset(monkeypatch):
    from lightning_npu import device as dev

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(var, "")  # recorded, so that what configure_allocator sets is undone after the test
        monkeypatch.delenv(var)
    assert dev.configure_allocator("cpu") is None  # no caching allocator
    assert dev.configure_allocator("npu") == dev.ALLOCATOR_DEFAULTS
    assert dev.allocator_env_var("npu") == "PYTORCH_NPU_ALLOC_CONF"
    import os

    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == dev.ALLOCATOR_DEFAULTS
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the user's choice stays
    assert dev.configure_allocator("cuda") is None
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # torch's device-generic name
    assert dev.configure_allocator("cuda") is None
