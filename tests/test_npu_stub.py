"""The NPU path without hardware: lightning_npu's torch_npu calls against a schema-checked stub.

The stub (tests/stubs/torch_npu) takes its signatures from op-plugin's schema lines and enforces
the kernels' documented limits, so these tests fail on a wrong keyword, a reserved argument, an
unsupported shape or dtype pair, and on any difference from the reference math.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_npu.ops import functional as fx
from lightning_npu.ops import npu, reference, rewrite_modules

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "tests" / "stubs"


@pytest.fixture
def tnpu(monkeypatch):
    """The stub importable as `torch_npu` for one test (no device registration in this process)."""
    monkeypatch.syspath_prepend(str(STUBS))
    monkeypatch.delenv("LNPU_STUB_NPU_DEVICE", raising=False)
    import torch_npu

    assert torch_npu.__version__.endswith("+stub")
    torch_npu.CALLS.clear()
    yield torch_npu
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]


def _calls(tnpu, name):
    return [kw for op, kw in tnpu.CALLS if op == name]


def test_stub_enforces_schema_and_documented_limits(tnpu):
    x, m = torch.randn(1, 1, 64, 64), torch.zeros(1, 1, 64, 64, dtype=torch.bool)
    with pytest.raises(TypeError):
        tnpu.npu_scaled_masked_softmax(x, m, 1.0, fixed_triu=False)  # not in the schema
    with pytest.raises(tnpu.KernelLimitError, match="reserved"):  # what ops/npu.py used to pass
        tnpu.npu_scaled_masked_softmax(x, m, 1.0, fixed_triu_mask=True)
    with pytest.raises(tnpu.KernelLimitError, match="divisible by 32"):
        tnpu.npu_scaled_masked_softmax(torch.randn(1, 1, 197, 197), m, 1.0)
    with pytest.raises(tnpu.KernelLimitError, match="not in the table"):  # fp32 x with a bf16 gamma
        tnpu.npu_rms_norm(torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16))
    assert len(tnpu.npu_fusion_attention(x, x, x, 1, "BNSD")) == 7 and len(tnpu.npu_rms_norm(x, torch.ones(64))) == 2


def test_npu_ops_match_reference(tnpu, monkeypatch):
    torch.manual_seed(0)
    close = dict(rtol=1e-5, atol=1e-5)
    # norms: fp32, and the dtype pairs the kernels do not take (fp32 x / bf16 gamma; fp64)
    x, r, w, b = torch.randn(3, 5, 64), torch.randn(3, 5, 64), torch.randn(64), torch.randn(64)
    for got, want in [
        (npu.add_layer_norm(x, r, w, b, 1e-5), reference.add_layer_norm(x, r, w, b, 1e-5)),
        (npu.add_rms_norm(x, r, w, 1e-6), reference.add_rms_norm(x, r, w, 1e-6)),
        (npu.add_rms_norm(x, None, w.bfloat16(), None), reference.add_rms_norm(x, None, w.bfloat16().float(), None)),
        (npu.add_rms_norm(x.double(), None, w.double(), 1e-6), reference.add_rms_norm(x.double(), None, w.double(), 1e-6)),
    ]:
        torch.testing.assert_close(got, want, **close)
    xb = x.bfloat16()
    y, _ = npu.add_rms_norm(xb, None, w, 1e-6)  # bf16 x, fp32 gamma: a pair in the table, no cast
    torch.testing.assert_close(y.float(), reference.add_rms_norm(xb.float(), None, w, 1e-6)[0], rtol=1e-2, atol=2e-2)
    assert _calls(tnpu, "npu_rms_norm")[-1]["gamma"].dtype == torch.float32
    assert len(_calls(tnpu, "npu_rms_norm")) == 3 and len(_calls(tnpu, "npu_add_layer_norm")) == 1
    g, u = torch.randn(4, 96), torch.randn(4, 96)
    torch.testing.assert_close(npu.swiglu(g, u), reference.swiglu(g, u), **close)
    # softmax: the causal triangle goes into the mask (fixed_triu_mask=False), on the kernel's shapes only
    s = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(npu.scale_mask_softmax(s, 0.5, True, None), reference.scale_mask_softmax(s, 0.5, True), **close)
    (call,) = _calls(tnpu, "npu_scaled_masked_softmax")
    assert call["fixed_triu_mask"] is False and call["mask"][0, 0, 0, 1] and not call["mask"][0, 0, 1, 0]
    for shape in [(1, 2, 197, 197), (1, 1, 32, 8192), (64, 64)]:  # outside [32, 4096] / not divisible / not 4-D
        s2 = torch.randn(*shape)
        torch.testing.assert_close(npu.scale_mask_softmax(s2, 1.0, True, None), reference.scale_mask_softmax(s2, 1.0, True), **close)
    assert len(_calls(tnpu, "npu_scaled_masked_softmax")) == 1
    # fully masked rows: zeros (as the CPU kernel), not the kernel's uniform rows
    mask = torch.zeros(2, 1, 64, 64, dtype=torch.bool)
    mask[:, :, 5] = True
    out = npu.scale_mask_softmax(s, 1.0, False, mask)
    want = reference.scale_mask_softmax(s, 1.0, False, mask).nan_to_num(0.0)
    torch.testing.assert_close(out, want, **close)
    assert out[:, :, 5].abs().max() == 0
    # attention: SDPA semantics, keep_mask True = attend, inverted for the kernel
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    keep = torch.rand(16, 16) > 0.3
    keep.fill_diagonal_(True)
    torch.testing.assert_close(
        npu.fusion_attention(q, k, v, keep, True, 8**-0.5),
        F.scaled_dot_product_attention(q, k, v, attn_mask=keep & ~reference.causal_mask(16, 16, q.device)), **close,
    )
    assert _calls(tnpu, "npu_fusion_attention")[-1]["head_num"] == 4
    # the SDPA module's dropout reaches the kernel as keep_prob, with the causal triangle as atten_mask
    monkeypatch.setattr(fx, "backend_for", lambda t: "npu")
    fx.causal_attention(q, k, v, 0.25)
    call = _calls(tnpu, "npu_fusion_attention")[-1]
    assert call["keep_prob"] == 0.75 and call["input_layout"] == "BNSD" and call["scale"] == 8**-0.5
    assert torch.equal(call["atten_mask"], reference.causal_mask(16, 16, q.device))


class SwiGLUMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


MODES = {  # precision mode -> (model dtype, autocast dtype or None, tolerance)
    "32-true": (torch.float32, None, 1e-5),
    "bf16-true": (torch.bfloat16, None, 3e-2),
    "16-true": (torch.float16, None, 3e-3),
    "bf16-mixed": (torch.float32, torch.bfloat16, 3e-2),
    "16-mixed": (torch.float32, torch.float16, 3e-3),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_rewrite_on_faked_npu_backend(tnpu, monkeypatch, mode):
    from examples.gpt.model import GPT, GPTConfig

    dtype, amp, tol = MODES[mode]
    torch.manual_seed(0)
    models = {
        "sdpa": GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32)),
        "explicit": GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32, attention="explicit")),
        "llama-ish": nn.Sequential(nn.RMSNorm(64, eps=1e-6), SwiGLUMLP(64), nn.RMSNorm(64)),
    }
    monkeypatch.setattr(fx, "backend_for", lambda t: "npu" if t.is_floating_point() else "eager")
    for name, plain in models.items():
        plain = plain.to(dtype).eval()
        fused = copy.deepcopy(plain)
        report = rewrite_modules(fused, device="npu")
        assert report.replaced and all(r.kernel in report.patterns for r in report.replaced)
        inp = torch.randint(0, 256, (2, 32)) if name != "llama-ish" else torch.randn(2, 32, 64, dtype=dtype)
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            want, got = plain(inp), fused(inp)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err <= tol, (name, mode, err)
    called = {op for op, _ in tnpu.CALLS}
    want = {"npu_fusion_attention", "npu_add_layer_norm", "npu_scaled_masked_softmax", "npu_rms_norm", "npu_swiglu"}
    if amp is not None:  # autocast: 16-bit attention output + fp32 residual, a pair npu_add_layer_norm lacks
        want.remove("npu_add_layer_norm")
    assert called == want


def test_guard_code_calls_only_schema_listed_torch_npu_ops(tnpu):
    """Every `tnpu.X` / `import_torch_npu().X` / `torch_npu.X` in the package must be in the copied schema list."""
    pattern = re.compile(r"\b(?:tnpu|torch_npu|import_torch_npu\(\))\.(npu_\w+)")
    used = {n for p in (ROOT / "lightning_npu").rglob("*.py") for n in pattern.findall(p.read_text())}
    assert pattern.findall("tnpu.npu_made_up(x)") == ["npu_made_up"]  # the scan itself finds calls
    assert used and used <= set(tnpu.SCHEMAS), sorted(used - set(tnpu.SCHEMAS))


def test_device_layer_with_privateuse1_renamed_to_npu():
    """In a fresh process, as after `import torch_npu` on an Ascend host (one fake device)."""
    script = textwrap.dedent(
        """
        import torch, torch_npu
        from lightning.pytorch import Trainer
        from lightning.pytorch.plugins.precision import MixedPrecision
        from lightning_npu import device as dev
        from lightning_npu.accelerator import NPUAccelerator

        assert torch.device("npu:0").type == "npu"
        assert dev.comm_backend("npu") == "hccl"
        assert dev.is_available("npu") and dev.device_count("npu") == 1
        stats = dev.memory_stats("npu:0")
        assert stats["allocated_bytes"] == 1 << 20 and stats["total_bytes"] == 64 << 30, stats
        assert dev.free_memory_bytes("npu:0") == 60 << 30
        with torch.autocast(dev.autocast_device_type("npu:0"), dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("npu") and not torch.is_autocast_enabled("cuda")
        trainer = Trainer(accelerator=NPUAccelerator(), devices=1, precision="bf16-mixed", strategy="auto",
                          logger=False, enable_checkpointing=False, enable_progress_bar=False)
        assert trainer.precision_plugin.device == "cuda"  # what Lightning builds for any accelerator but cpu/mps
        trainer.strategy.accelerator.setup(trainer)  # what every strategy calls before using the plugin
        plugin = trainer.precision_plugin
        assert type(plugin) is MixedPrecision and plugin.device == "npu", plugin.device
        with plugin.forward_context():
            assert torch.is_autocast_enabled("npu") and not torch.is_autocast_enabled("cuda")
        print("device layer ok")
        """
    )
    env = {**os.environ, "LNPU_STUB_NPU_DEVICE": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "PYTHONPATH": os.pathsep.join([str(STUBS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "device layer ok" in out.stdout, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    npu_line = [i for i, line in enumerate(lines) if "NPU available:" in line]
    assert len(npu_line) == 1 and lines[npu_line[0]].endswith("NPU available: True (torch_npu), used: True"), lines
    # said when the accelerator is built, a line or two (the precision plugin's) before Lightning's own
    assert any("GPU available:" in line for line in lines[npu_line[0] + 1: npu_line[0] + 4]), lines


def test_torch_npu_import_errors_carry_the_install_hint(monkeypatch):
    from lightning_npu import device as dev

    def broken(name):
        raise RuntimeError("torch_npu needs a CPU build of torch")  # what a CUDA torch gets

    monkeypatch.setattr(dev.importlib, "import_module", broken)
    with pytest.raises(dev.NPUUnavailableError, match="pip install torch-npu") as info:
        dev.import_torch_npu()
    assert "RuntimeError" in str(info.value)


def test_rms_norm_default_eps_is_torch_default():
    """eps=None: F.rms_norm takes fp32's epsilon for 16-bit inputs; with the bf16 one small activations drift ~50%."""
    x = (torch.randn(4, 64) * 0.05).bfloat16()
    for w in (None, torch.ones(64)):
        want = F.rms_norm(x.float(), (64,), w, None)
        torch.testing.assert_close(fx.rms_norm(x, w, None).float(), want, rtol=1e-2, atol=1e-2)


def test_fuse_ops_takes_a_pattern_list_or_all():
    from lightning_npu import NPUHybridStrategy
    from lightning_npu.parallel.config import ParallelConfigError

    for ok in (True, False, "all", ["swiglu", "rms_norm"]):
        NPUHybridStrategy(fuse_ops=ok)
    for bad in (1, "some", ["swiglu", "flash"]):
        with pytest.raises(ParallelConfigError, match="fuse_ops"):
            NPUHybridStrategy(fuse_ops=bad)
