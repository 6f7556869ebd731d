"""HybridPrecision: fp32 norms/softmax, loss scaling with an all-reduced skip, global clipping, resume."""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import lightning_npu  # noqa: F401
from examples.gpt.model import GPT, CausalSoftmax, GPTConfig
from lightning_npu import HybridPrecision
from lightning_npu.launch import spawn
from lightning_npu.parallel.checkpoint.safe_load import checkpoint_tensor_metadata, read_meta
from lightning_npu.precision.loss_scaler import DynamicLossScaler
from tests._precision_workers import loss_curves, train_many

# fp32 parity tolerances, as in tests/test_foundation_parity.py (see there for why atol 1e-6 on params)
RTOL, ATOL = 1e-5, 1e-6
# bf16-mixed vs fp32 loss over 50 steps of the tiny GPT: measured max |diff| 2.4e-3 (rel 1.1e-3) at
# n_embd=64; the bound below leaves ~8x margin while a broken bf16 path (e.g. bf16 softmax + unscaled
# or double-scaled gradients) moves the curve by far more than 0.02.
LOSS_CURVE_ATOL, LOSS_CURVE_RTOL = 0.02, 0.01


# ---- fp32 islands --------------------------------------------------------------------------
class _Probe:
    """Hooks that see what a module's forward actually receives and returns (after our pre-hook,
    before our cast-back) and whether autocast is on inside it."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.seen: list[tuple[str, torch.dtype, torch.dtype, bool]] = []
        for m in modules:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post, prepend=True)

    def _pre(self, module, args):
        self._in = (args[0].dtype, torch.is_autocast_enabled(args[0].device.type))

    def _post(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        self.seen.append((type(module).__name__, self._in[0], out.dtype, self._in[1]))


class _SoftmaxObserver(TorchFunctionMode):
    """Entered *outside* forward_context: sees functional softmax calls after HybridPrecision's mode."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.dtype] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax):
            self.inputs.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, attention="explicit"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_gpt_norms_and_softmax_run_in_fp32(precision):
    idx = torch.randint(0, 64, (2, 16))
    islands = lambda m: [x for x in m.modules() if isinstance(x, (nn.LayerNorm, CausalSoftmax))]  # noqa: E731

    # without HybridPrecision, CPU autocast runs softmax in bf16 (so this test can fail)
    baseline = _tiny_gpt()
    probe = _Probe(islands(baseline))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        baseline(idx)
    assert any(s[1] == torch.bfloat16 for s in probe.seen if s[0] == "CausalSoftmax")

    plugin = HybridPrecision(precision, device="cpu")
    model = plugin.convert_module(_tiny_gpt())
    probe = _Probe(islands(model))
    with plugin.forward_context():
        logits = model(plugin.convert_input(idx))
    assert logits.dtype == torch.bfloat16  # the forward is bf16...
    assert len(probe.seen) == 2 * 3 + 1  # 2 blocks x (ln_1, softmax, ln_2) + ln_f
    for name, dtype_in, dtype_out, autocast_on in probe.seen:  # ...the islands are fp32 with autocast off
        assert (dtype_in, dtype_out, autocast_on) == (torch.float32, torch.float32, False), name
    if precision == "bf16-true":
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # one dtype (ZeRO-1), fp32 masters


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_llama_rmsnorm_and_softmax_run_in_fp32(precision):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    cfg._attn_implementation = "eager"  # softmax as a functional call (sdpa keeps it inside the kernel)
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 8))
    rms_norms = lambda m: [x for x in m.modules() if type(x).__name__ == "LlamaRMSNorm"]  # noqa: E731

    if precision == "bf16-true":
        # without HybridPrecision a bf16 Llama feeds its RMSNorms and softmax bf16 (so this test can fail).
        # (Under CPU autocast with fp32 weights Llama's residual stream and masked scores are fp32 anyway.)
        baseline = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        probe, observer = _Probe(rms_norms(baseline)), _SoftmaxObserver()
        with observer:
            baseline(idx)
        assert observer.inputs == [torch.bfloat16] * 2
        assert all(s[1] == torch.bfloat16 for s in probe.seen)

    model = transformers.LlamaForCausalLM(cfg)
    plugin = HybridPrecision(precision, device="cpu")
    plugin.convert_module(model)
    norms = rms_norms(model)
    assert len(norms) == 2 * 2 + 1
    probe, observer = _Probe(norms), _SoftmaxObserver()
    with observer, plugin.forward_context():
        out = model(idx)
    assert out.logits.dtype == torch.bfloat16  # the forward is bf16
    assert len(probe.seen) == len(norms)
    assert all(s[1:] == (torch.float32, torch.float32, False) for s in probe.seen), probe.seen
    assert observer.inputs == [torch.float32] * 2, observer.inputs  # one softmax per layer, fp32


def test_functional_softmax_and_loss_are_upcast():
    plugin = HybridPrecision("bf16-mixed", device="cpu")
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with plugin.forward_context():
        # a bf16 softmax is visibly less accurate than fp32; ours must match the fp32 result rounded once
        sm = torch.softmax(x, -1)
        loss = torch.nn.functional.cross_entropy(x, torch.zeros(4, dtype=torch.long))
    assert sm.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert torch.equal(sm, torch.softmax(x.float(), -1).to(torch.bfloat16))
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(x.float(), torch.zeros(4, dtype=torch.long)))


# ---- loss scaler and configuration ----------------------------------------------------------
def test_dynamic_loss_scaler_schedule():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    trace = []
    for found_inf in [False, False, True, True, True, False, False, False, True, True, True, True]:
        s.update(found_inf)
        trace.append(s.scale)
    # overflow 1 is absorbed by the hysteresis, overflows 2 and 3 halve; 3 clean steps double (and refill
    # the hysteresis); then the floor holds
    assert trace == [8, 8, 8, 4, 2, 2, 2, 4, 4, 2, 2, 2]
    assert HybridPrecision("bf16-mixed").loss_scale == 2.0**10
    assert HybridPrecision("32-true").scaler is None and HybridPrecision("bf16-mixed", loss_scale=None).scaler is None
    static = HybridPrecision("bf16-mixed", loss_scale=128)
    static.scaler.update(True)
    assert static.loss_scale == 128


def test_precision_flags_map_to_hybrid_precision_and_others_fail():
    for flag in ["32-true", "bf16-mixed", "bf16-true"]:
        trainer = L.Trainer(strategy="npu_hybrid", accelerator="cpu", devices=1, precision=flag, logger=False)
        plugin = trainer.strategy.precision_plugin
        assert isinstance(plugin, HybridPrecision) and plugin.precision == flag and plugin.device == "cpu"
    with pytest.raises(ValueError, match=r"does not support the precision plugin DoublePrecision.*'64-true'"):
        L.Trainer(strategy="npu_hybrid", accelerator="cpu", devices=1, precision="64-true", logger=False)
    with pytest.raises(ValueError, match=r"HybridPrecision\(precision='fp8'\) is not supported"):
        HybridPrecision("fp8")
    with pytest.raises(ValueError, match=r"loss_scale='static'"):
        HybridPrecision("bf16-mixed", loss_scale="static")
    with pytest.raises(ValueError, match=r"`hysteresis=0` is invalid"):
        HybridPrecision("bf16-mixed", hysteresis=0)


# ---- multi-process ---------------------------------------------------------------------------
_OVERFLOW_REC = {"snapshot_params": True, "inject_inf_at": (2, 3), "inject_rank": 1}
_EPOCHS = (0, 3)  # seed, limit_train_batches: 3-step epochs, resume at a boundary


def _overflow_args(precision: str, zero_stage: int) -> tuple:
    return (8, precision, 8, {"zero_stage": zero_stage}, {"warmup_steps": 4}, {"growth_interval": 3}, None,
            _OVERFLOW_REC)


def _assert_skipped_everywhere(ranks: list[dict]) -> None:
    for r in ranks:
        rows = r["rows"]
        assert [row["loss_scale"] for row in rows] == [1024, 1024, 1024, 512, 512, 512, 1024, 1024]
        assert [row["skipped_steps"] for row in rows] == [0, 0, 1, 2, 2, 2, 2, 2]
        assert [row["sched_last_epoch"] for row in rows] == [1, 2, 2, 2, 3, 4, 5, 6]  # scheduler skipped too
        for k in rows[0]["params"]:
            assert torch.equal(rows[2]["params"][k], rows[1]["params"][k]), k  # step 2 skipped
            assert torch.equal(rows[3]["params"][k], rows[1]["params"][k]), k  # step 3 skipped
        assert any(not torch.equal(rows[4]["params"][k], rows[3]["params"][k]) for k in rows[0]["params"])
        assert rows[-1]["loss"] < rows[0]["loss"] and all(torch.isfinite(v).all() for v in r["state"].values())
    for k in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]), k


_TRAIN_ARGS = ("steps", "precision", "global_batch", "strategy_kwargs", "model_kwargs", "plugin_kwargs",
               "gradient_clip_val", "recorder_kwargs")


def _overflow(precision: str, zero_stage: int, **kw) -> dict:
    """A dp=2 `train` config with the injected overflows (`_overflow_args`), 3-step epochs."""
    return dict(devices=2, **dict(zip(_TRAIN_ARGS, _overflow_args(precision, zero_stage))),
                **dict(zip(("seed", "limit_train_batches"), _EPOCHS)), **kw)


def _bf16_true(zero_stage: int, **kw) -> dict:
    return dict(devices=2, steps=6, precision="bf16-true",  # about sharded (DCP) checkpoints: ask for them
                strategy_kwargs={"zero_stage": zero_stage, "save_distributed_checkpoint": True},
                model_kwargs={"warmup_steps": 4}, recorder_kwargs={"snapshot_masters": True},
                limit_train_batches=3, **kw)


BF16_TRUE_STAGES = (0, 1, 3)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """Every dp=2 run of the module in two launches (start-up and imports paid once each): the uninterrupted runs
    (the bf16-true overflow run, the bf16-mixed one checkpointing, bf16-true under ZeRO 0/1/3 checkpointing), then
    the resumes from their step-3 checkpoints. Each run's per-rank results, by name."""
    root = tmp_path_factory.mktemp("precision")
    ckpt = {"overflow": root / "overflow", **{z: root / f"zero{z}" for z in BF16_TRUE_STAGES}}
    step3 = {k: v / "epoch=0-step=3.ckpt" for k, v in ckpt.items()}
    full = [_overflow("bf16-true", 1, ckpt_dir=None), _overflow("bf16-mixed", 0, ckpt_dir=str(ckpt["overflow"])),
            *(_bf16_true(z, ckpt_dir=str(ckpt[z])) for z in BF16_TRUE_STAGES)]
    resumed = [_overflow("bf16-mixed", 0, ckpt_in=str(step3["overflow"])),
               *(_bf16_true(z, ckpt_in=str(step3[z])) for z in BF16_TRUE_STAGES)]
    runs = [spawn(train_many, 2, configs) for configs in (full, resumed)]
    full_ranks, resumed_ranks = ([[rank[i] for rank in ranks] for i in range(len(ranks[0]))] for ranks in runs)
    return {"step3": step3, "skip_zero1": full_ranks[0], "overflow": full_ranks[1],
            "overflow_resumed": resumed_ranks[0], "bf16_true": dict(zip(BF16_TRUE_STAGES, full_ranks[2:])),
            "bf16_true_resumed": dict(zip(BF16_TRUE_STAGES, resumed_ranks[1:]))}


def test_overflow_on_one_rank_skips_everywhere_under_zero1(dp2):
    """An inf in rank 1's gradient only (after DDP's all-reduce) at steps 2 and 3: both ranks skip both steps
    (parameters and LR schedule unchanged; a per-rank decision would deadlock ZeRO-1's all-gathers), the scale
    halves on the second overflow (hysteresis 2), then grows after 3 clean steps; training continues.
    bf16-true: bf16 parameters, the DistributedOptimizer's fp32 master slices."""
    _assert_skipped_everywhere(dp2["skip_zero1"])


def test_overflow_skip_and_resume_restore_the_loss_scale(dp2):
    """bf16-mixed, dp=2 (DDP): the same skips; a run resumed from the step-3 checkpoint restores the scaler
    (incl. its hysteresis state) exactly and repeats the uninterrupted run bit for bit. (ZeRO-1 + scheduler resume:
    tests/test_foundation_parity.py; bf16-true under ZeRO 0/1: test_bf16_true_checkpoint_resume_dp2_zero0_1_3.)"""
    full = dp2["overflow"]
    _assert_skipped_everywhere(full)
    ckpt = dp2["step3"]["overflow"]
    # the default single file under dp-only ZeRO 0 (a sharded directory keeps it in rank 0's meta.pt)
    saved = (read_meta(ckpt) if ckpt.is_dir() else torch.load(ckpt, weights_only=False))["HybridPrecision"]
    assert saved["loss_scaler"] == {"scale": 1024.0, "growth_tracker": 0, "hysteresis_tracker": 1}
    for r, f in zip(dp2["overflow_resumed"], full):  # each rank's local losses (ranks see different data)
        assert r["global_step"] == 8
        # a fresh scaler (hysteresis 2) would absorb step 3's overflow and keep 1024
        assert [row["loss_scale"] for row in r["rows"]] == [512, 512, 512, 1024, 1024]
        assert r["scaler"] == f["scaler"]
        assert [row["loss"] for row in r["rows"]] == [row["loss"] for row in f["rows"][3:]]
        for k, v in f["state"].items():
            assert torch.equal(r["state"][k], v), k


def test_bf16_mixed_loss_curve_tracks_fp32():
    curves = spawn(loss_curves, 1, ["32-true", "bf16-mixed"], 50)[0]
    fp32, bf16 = torch.tensor(curves["32-true"]), torch.tensor(curves["bf16-mixed"])
    assert len(fp32) == len(bf16) == 50 and fp32[-1] < fp32[0] - 2.0  # it trained
    torch.testing.assert_close(bf16, fp32, atol=LOSS_CURVE_ATOL, rtol=LOSS_CURVE_RTOL)
    assert not torch.equal(bf16, fp32)  # and it really computed in bf16


def test_bf16_true_checkpoint_resume_dp2_zero0_1_3(dp2):
    """bf16-true keeps fp32 master weights outside the module (HybridPrecision's under ZeRO 0, the
    DistributedOptimizer's slices under ZeRO 1; the optimizer steps them): a sharded (DCP)
    checkpoint must still save (DCP keys optimizer state by parameter FQN), hold the fp32 masters exactly, and a
    resumed run must restore them bit for bit and repeat the uninterrupted loss curve, under ZeRO 0 and ZeRO 1."""
    for z in BF16_TRUE_STAGES:
        meta = read_meta(dp2["step3"][z])
        assert "master_weights" not in meta["HybridPrecision"]  # they are the DCP model tensors, fp32
        stored = checkpoint_tensor_metadata(dp2["step3"][z])
        assert stored["state_dict.model.lm_head.weight"].properties.dtype == torch.float32
        assert any(k.startswith("optimizer_0.state.") and k.endswith(".exp_avg_sq") for k in stored)
        for f, r in zip(dp2["bf16_true"][z], dp2["bf16_true_resumed"][z]):
            assert r["global_step"] == 6 and r["plugin"] == "HybridPrecision"
            saved = f["rows"][2]["masters"]
            assert saved and r["start_masters"].keys() == saved.keys()
            for k, v in saved.items():
                assert v.dtype == torch.float32 and torch.equal(r["start_masters"][k], v), f"zero {z} {k}"
            assert [row["loss"] for row in r["rows"]] == [row["loss"] for row in f["rows"][3:]], f"zero {z}"
            for k, v in f["rows"][-1]["masters"].items():
                assert torch.equal(r["rows"][-1]["masters"][k], v), f"zero {z} {k}"
            for k, v in f["state"].items():
                assert torch.equal(r["state"][k], v), f"zero {z} {k}"


def _matmul_calls(x, w, b, q, k, v):
    import torch.nn.functional as F

    return [F.linear(x, w, b), x @ w.t(), torch.matmul(x, w.t()), torch.bmm(q, k.transpose(1, 2)),
            F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)]


def test_emulated_bf16_matmuls_compute_what_bf16_kernels_do():
    """CPUs without bf16 instructions run bf16 GEMMs as fp32 GEMMs of the bf16-rounded operands (about 10x faster
    there): the same dtypes out and the same values to bf16 rounding, forward and backward, under bf16 autocast
    and for bf16 operands; fp32 math outside autocast is left alone."""
    from lightning_npu.precision.emulation import EmulatedBF16MatmulMode

    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(*s, generator=g).requires_grad_() for s in [(6, 64), (32, 64), (32,), (2, 16, 64),
                                                                        (2, 16, 64), (2, 16, 64)]]

    def run(emulate, autocast, dtype):
        args = [t.detach().to(dtype).requires_grad_() for t in leaves]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with EmulatedBF16MatmulMode() if emulate else contextlib.nullcontext():
                outs = _matmul_calls(*args)
        sum(o.float().square().sum() for o in outs).backward()
        return outs, [a.grad for a in args]

    for autocast, dtype in [(True, torch.float32), (False, torch.bfloat16)]:
        (native, native_grads), (emulated, emulated_grads) = run(False, autocast, dtype), run(True, autocast, dtype)
        for a, b in zip(native + native_grads, emulated + emulated_grads):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)  # bf16: eps 7.8e-3
    fp32, _ = run(False, False, torch.float32)
    untouched, _ = run(True, False, torch.float32)
    for a, b in zip(fp32, untouched):
        assert b.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_emulation_only_where_the_cpu_lacks_bf16(monkeypatch, fast):
    """`HybridPrecision` enters the emulation in its forward (and recompute) context only on a CPU without bf16
    instructions, and the example GPT's bf16-mixed step agrees with the native kernels' (measured: loss 1e-6 apart,
    gradients 0.3% in relative norm)."""
    from torch.overrides import _get_current_function_mode_stack

    from lightning_npu import device as dev
    from lightning_npu.precision.emulation import EmulatedBF16MatmulMode

    monkeypatch.setattr(dev, "fast_bf16", lambda device_type: fast)
    plugin = HybridPrecision("bf16-mixed", device="cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (2, 32))

    def step(context):
        with context():
            modes = [type(m) for m in _get_current_function_mode_stack()]
            loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad()
        return modes, loss, grads

    modes, loss, grads = step(plugin.forward_context)
    assert (EmulatedBF16MatmulMode in modes) is not fast
    assert (EmulatedBF16MatmulMode in step(plugin.recompute_context)[0]) is not fast
    monkeypatch.setattr(dev, "fast_bf16", lambda device_type: not fast)
    other_modes, other_loss, other_grads = step(plugin.forward_context)
    assert (EmulatedBF16MatmulMode in other_modes) is fast
    torch.testing.assert_close(loss, other_loss, rtol=1e-4, atol=1e-4)
    assert (grads - other_grads).norm() <= 2e-2 * grads.norm()
