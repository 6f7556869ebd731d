"""Activation checkpointing (`activation_checkpointing`): exact against no recompute, and really recomputing."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_npu
from examples.gpt.model import GPT, GPTConfig, GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import MemoryMonitor
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.recompute import apply_activation_checkpointing
from tests._gpt_workers import SMALL_GPT, LossRecorder, parity_trainer
from tests._layouts import launch_calls

POLICIES = [1, 2, 4, "full", "selective"]


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _step(model: GPT, x: torch.Tensor, policy) -> dict:
    model = copy.deepcopy(model)
    if policy is not None:
        apply_activation_checkpointing(model, policy)
    calls = [0] * len(model.transformer.h)
    for i, block in enumerate(model.transformer.h):
        # a pre-hook: the recompute stops as soon as backward has what it needs, so a block's post-hooks may not rerun
        block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    torch.manual_seed(1)  # dropout masks: the recompute must draw the same ones
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    with _OpCounter() as ops:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "calls": calls, "backward_ops": ops.counts}


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64, dropout=0.1))
    x = torch.randint(0, 64, (4, 32))
    return {p: _step(model, x, p) for p in [None, *POLICIES]}


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_exact_with_dropout_and_recomputes_the_chosen_blocks(runs, policy):
    ref, got = runs[None], runs[policy]
    assert torch.equal(got["loss"], ref["loss"])
    assert got["grads"].keys() == ref["grads"].keys()  # parameter names unchanged (no wrapper module)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-6, msg=name)
    every = 1 if isinstance(policy, str) else policy
    assert got["calls"] == [2 if (i + 1) % every == 0 else 1 for i in range(4)]
    assert ref["calls"] == [1, 1, 1, 1]


def test_selective_keeps_matmul_outputs(runs):
    """Backward of "full" re-runs the blocks' linear layers; "selective" re-runs only the cheap ops."""
    none, full, selective = (runs[p]["backward_ops"] for p in (None, "full", "selective"))
    matmuls = ("addmm", "bmm")
    assert sum(full.get(op, 0) for op in matmuls) > sum(none.get(op, 0) for op in matmuls)
    assert all(selective.get(op, 0) == none.get(op, 0) for op in matmuls)
    assert selective.get("native_layer_norm", 0) == full.get("native_layer_norm", 0) > 0  # norms recomputed


@pytest.mark.parametrize("value", [0, -1, "sometimes", True, 1.5])
def test_bad_values_name_the_argument(value):
    with pytest.raises(ParallelConfigError, match="activation_checkpointing"):
        NPUHybridStrategy(activation_checkpointing=value)


@pytest.mark.parametrize("kwargs, match", [
    ({"activation_checkpointing": "auto", "memory_budget_gb": -1}, "memory_budget_gb=-1"),
    ({"activation_checkpointing": "full", "memory_budget_gb": 8}, "only by activation_checkpointing='auto'"),
    ({"activation_checkpointing": "auto", "pipeline_parallel_size": 2}, "choose an int N, 'full' or 'selective'"),
])
def test_auto_bad_combinations(kwargs, match):
    with pytest.raises(ParallelConfigError, match=match):
        NPUHybridStrategy(**kwargs)


def test_more_than_the_blocks_warns():
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))
    with pytest.warns(UserWarning, match="larger than the 2 blocks of `transformer.h`"):
        report = apply_activation_checkpointing(model, 3)
    assert report.checkpointed == ()


# (layout kwargs, policy, precision): each trained with and without recompute in the same processes, dropout on
LAYOUTS = [
    ({"tensor_parallel_size": 2, "zero_stage": 0}, "full", "32-true"),
    ({"tensor_parallel_size": 2, "zero_stage": 1, "sequence_parallel": True}, 1, "32-true"),
    ({"pipeline_parallel_size": 2, "zero_stage": 0}, 1, "32-true"),
    ({"zero_stage": 3}, "selective", "32-true"),
    ({"zero_stage": 1, "fuse_ops": "all"}, "full", "bf16-mixed"),  # the fused fp32 islands recompute identically
]


def _train(layout: dict, policy, precision: str) -> dict:
    L.seed_everything(0, verbose=False)
    model = GPTModule(**{**SMALL_GPT, "dropout": 0.1})
    recorder = LossRecorder()
    strategy = NPUHybridStrategy(**layout, activation_checkpointing=policy)
    trainer, data = parity_trainer(strategy, model, 2, 8, 3, [recorder], precision=precision)
    trainer.fit(model, datamodule=data)
    report = strategy.recompute_report
    return {"losses": torch.tensor(recorder.logged), "state": lightning_npu.full_state_dict(model),
            "checkpointed": None if report is None else report.checkpointed}


def _compare_layouts() -> list:
    return [(_train(layout, None, precision), _train(layout, policy, precision)) for layout, policy, precision in LAYOUTS]


@pytest.fixture(scope="module")
def dp2():
    """The module's 2-process runs in one launch (start-up and imports paid once): the memory-budget runs first (a
    fresh process, as alone), then every layout with and without recompute; per call, each rank's result."""
    auto, layouts = launch_calls(2, [(_auto_runs, {}), (_compare_layouts, {})])
    return {"auto": auto, "layouts": layouts}


def test_recompute_is_exact_in_every_layout(dp2):
    """tp (with and without sequence parallelism), pp, ZeRO-3, and bf16-mixed with fused ops, dropout on: the same
    losses and parameters as the same layout without recompute (the recompute redraws the same dropout masks on every
    rank and runs under the same autocast state)."""
    for rank, results in enumerate(dp2["layouts"]):
        for (layout, policy, precision), (ref, got) in zip(LAYOUTS, results):
            where = f"rank {rank}, {layout}, {policy!r}, {precision}"
            assert got["checkpointed"], where
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=1e-6, msg=where)
            for key, value in ref["state"].items():
                torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-6, msg=f"{where}: {key}")


AUTO_GPT = {**SMALL_GPT, "n_layer": 4, "dropout": 0.1}


def _fit_auto(policy, budget_gb=None, steps: int = 4) -> dict:
    L.seed_everything(0, verbose=False)
    model = GPTModule(**AUTO_GPT)
    recorder, monitor = LossRecorder(), MemoryMonitor()
    strategy = NPUHybridStrategy(zero_stage=1, activation_checkpointing=policy, memory_budget_gb=budget_gb)
    trainer, data = parity_trainer(strategy, model, 2, 8, steps, [recorder, monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data)
    report = strategy.recompute_report
    return {"losses": torch.tensor(recorder.logged), "k": None if report is None else len(report.checkpointed),
            "last": dict(monitor.last), "warned": any("over the budget" in str(w.message) for w in caught),
            "state": sum(monitor.last[k] for k in ("parameters", "gradients", "optimizer_state"))}


def _auto_runs() -> dict:
    none = _fit_auto(None)
    middle_gb = (none["state"] + 0.6 * none["last"]["activations_peak"]) / 1e9
    return {"none": none, "roomy": _fit_auto("auto", 10.0), "tight": _fit_auto("auto", 1e-6),
            "middle": _fit_auto("auto", middle_gb), "middle_gb": middle_gb}


def test_auto_fits_the_budget_with_the_fewest_blocks(dp2):
    for rank, runs in enumerate(dp2["auto"]):
        none, roomy, tight, middle = runs["none"], runs["roomy"], runs["tight"], runs["middle"]
        assert roomy["k"] == 0 and not roomy["warned"], rank  # everything fits: nothing recomputed after step 1
        assert tight["k"] == 4 and tight["warned"], rank  # nothing fits: every block, and a warning
        assert 0 < middle["k"] < 4, (rank, middle["k"])
        assert middle["last"]["activations_peak"] <= runs["middle_gb"] * 1e9 - middle["state"], rank
        for run in (roomy, tight, middle):  # recompute is exact whatever it chose
            torch.testing.assert_close(run["losses"], none["losses"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_transformers_llama_decoder_layers(attention, policy):
    """A `transformers` model: its decoder layer list is what recomputes, exactly (GQA, rotary, SwiGLU, SDPA and eager
    attention). Left at its default ``use_cache=True`` the model would append each block's keys to its cache again in
    the recompute (eager attention then failed on a mask half the keys' length)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, attn_implementation=attention)
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 64, (2, 16))
    grads = []
    for recompute in (None, policy):
        m = copy.deepcopy(model)
        if recompute is not None:
            report = apply_activation_checkpointing(m, recompute)
            assert report.blocks == "model.layers" and report.checkpointed == (0, 1)
            assert m.config.use_cache is False
        m(x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


class _FunctionalSoftmaxGPT(torch.nn.Module):
    """Blocks whose forward calls `F.softmax` itself: the fp32 function mode, not a module hook, must upcast it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + F.softmax(block(x), dim=-1)
        return x


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("fast_bf16", [True, False])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_recompute_replays_the_precision_function_modes(monkeypatch, policy, fast_bf16, precision):
    """The recompute runs in backward, outside `forward_context`: it re-enters the function modes the forward ran
    under (fp32 softmax, and the emulated bf16 matmuls of a CPU without bf16 units), so torch's checkpoint finds the
    same saved tensors (else: CheckpointError on their dtypes) and the gradients equal those without recompute."""
    from lightning_npu import HybridPrecision
    from lightning_npu import device as dev

    monkeypatch.setattr(dev, "fast_bf16", lambda device_type: fast_bf16)
    plugin = HybridPrecision(precision, device="cpu")
    torch.manual_seed(0)
    plain = plugin.convert_module(_FunctionalSoftmaxGPT())
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, policy)
    x = plugin.convert_input(torch.randn(4, 16))
    grads = []
    for model in (plain, checkpointed):
        with plugin.forward_context():
            out = model(x)
        out.float().square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
