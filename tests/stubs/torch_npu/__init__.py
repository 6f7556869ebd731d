"""A test stand-in for ``torch_npu``: the fused ops lightning_npu calls, on CPU tensors.

Signatures come from op-plugin's schema lines (op_plugin_schema.txt), so a misspelt or
missing argument fails exactly as ``inspect.signature().bind`` would; each op returns the real
number of outputs, computes the documented math in fp32 and enforces the documented limits
(torch_npu API reference, op-plugin docs/zh/custom_APIs): mask True = masked out, shape rules,
dtype tables, ``fixed_triu_mask`` reserved. ``CALLS`` records every call for the tests.

With ``LNPU_STUB_NPU_DEVICE=1`` it also plays the device layer like the real package does on
import: the privateuse1 backend is renamed to "npu", ``torch.npu`` is registered (one device,
fake allocator numbers) and "hccl" becomes the npu collective backend.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from . import _schema

__version__ = "0.0.0+stub"
SCHEMAS = _schema.load()
CALLS: list[tuple[str, dict]] = []
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class KernelLimitError(RuntimeError):
    """What the real kernel would reject (the message names the documented rule)."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise KernelLimitError(msg)


def _op(fn):
    sig, n_out = SCHEMAS[fn.__name__]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)  # TypeError on a keyword the schema does not have
        bound.apply_defaults()
        CALLS.append((fn.__name__, dict(bound.arguments)))
        out = fn(**bound.arguments)
        assert (len(out) if isinstance(out, tuple) else 1) == n_out, fn.__name__
        return out

    wrapper.__signature__ = sig
    return wrapper


@_op
def npu_scaled_masked_softmax(x, mask, scale=1, fixed_triu_mask=False):
    _require(fixed_triu_mask is False, "fixed_triu_mask is reserved: only False is supported")
    _require(x.dtype in _FLOATS, f"x dtype {x.dtype} not in float16/float32/bfloat16")
    _require(mask.dtype == torch.bool, f"mask dtype {mask.dtype} must be bool")
    _require(x.dim() == 4, "x must be NCHW (4-D)")
    for n in x.shape[-2:]:
        _require(32 <= n <= 4096 and n % 32 == 0, f"H and W must be in [32, 4096] and divisible by 32, got {tuple(x.shape)}")
    try:
        torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        raise KernelLimitError(f"mask {tuple(mask.shape)} does not broadcast to x {tuple(x.shape)}") from None
    _require(torch.broadcast_shapes(mask.shape, x.shape) == x.shape, "mask must broadcast to x's shape")
    # masked logits get a finite fill (fully masked rows come out uniform, unlike -inf)
    z = (x.float() * float(scale)).masked_fill(mask, -10000.0)
    return torch.softmax(z, dim=-1).to(x.dtype)


_RMS_DTYPES = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
}


@_op
def npu_rms_norm(self, gamma, epsilon=1e-06):
    x = self
    _require((x.dtype, gamma.dtype) in _RMS_DTYPES, f"(self, gamma) dtypes ({x.dtype}, {gamma.dtype}) not in the table")
    _require(tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim():]), "gamma_shape must equal self_shape[n:]")
    xf = x.float()
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


@_op
def npu_add_layer_norm(x1, x2, gamma, beta, epsilon=1e-05, additional_output=False):
    _require(x1.dtype in _FLOATS and x2.dtype == x1.dtype, f"x1/x2 dtypes {x1.dtype}/{x2.dtype} must match")
    _require(gamma.dtype == beta.dtype == x1.dtype, "gamma/beta must have x1's dtype")
    h = x1.float() + x2.float()
    mean = h.mean(-1, keepdim=True)
    rstd = torch.rsqrt(h.var(-1, unbiased=False, keepdim=True) + epsilon)
    y = ((h - mean) * rstd * gamma.float() + beta.float()).to(x1.dtype)
    return y, mean, rstd, (h.to(x1.dtype) if additional_output else torch.empty(0))


@_op
def npu_swiglu(self, dim=-1):
    _require(self.size(dim) % 2 == 0, "the split dim must have an even length")
    a, b = self.chunk(2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(self.dtype)


@_op
def npu_fusion_attention(
    query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
    keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0, prefix=None,
    actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0,
):
    _require(input_layout == "BNSD", f"stub implements input_layout='BNSD' only, got {input_layout!r}")
    _require(query.dtype in _FLOATS and query.dtype == key.dtype == value.dtype, "q/k/v dtypes must match")
    _require(key.shape == value.shape, "key and value shapes must match")
    _require(query.size(1) == head_num, f"head_num={head_num} but query has {query.size(1)} heads")
    _require(query.size(1) % key.size(1) == 0, "Nq / Nkv must be an integer")
    _require(0.0 < keep_prob <= 1.0, "keep_prob must be in (0, 1]")
    _require(padding_mask is None, "padding_mask is not supported")
    _require(sparse_mode == 0 or atten_mask is not None, "sparse_mode != 0 needs the matching atten_mask")
    b, n, sq, d = query.shape
    sk = key.size(2)
    s = torch.einsum("bnqd,bnkd->bnqk", query.float(), key.float().repeat_interleave(n // key.size(1), 1)) * scale
    if atten_mask is not None:
        _require(atten_mask.dtype in (torch.bool, torch.uint8), "atten_mask dtype must be bool or uint8")
        ok = {(sq, sk), (1, 1, sq, sk), (b, 1, sq, sk), (b, n, sq, sk)}
        _require(tuple(atten_mask.shape) in ok, f"atten_mask shape {tuple(atten_mask.shape)} not SS/11SS/B1SS/BNSS")
        s = s + atten_mask.float() * -10000.0  # 1 = masked out
    p = torch.softmax(s, dim=-1)
    if keep_prob < 1.0:
        p = F.dropout(p, 1.0 - keep_prob)
    out = torch.einsum("bnqk,bnkd->bnqd", p, value.float().repeat_interleave(n // key.size(1), 1))
    stats = torch.zeros(b, n, sq, 8)
    return out.to(query.dtype), stats, stats.clone(), torch.empty(0), 0, 0, 0


def _install_device() -> None:
    """What the real torch_npu does on import, minus the hardware: one fake 'npu' device."""
    import sys
    import types

    import torch.distributed as dist

    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    mod = types.ModuleType("torch.npu")
    state = {"allocated": 1 << 20, "reserved": 2 << 20, "peak": 3 << 20}
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.is_initialized = lambda: False
    mod.current_device = lambda: 0
    mod.set_device = lambda device: None
    mod.synchronize = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.memory_allocated = lambda device=None: state["allocated"]
    mod.memory_reserved = lambda device=None: state["reserved"]
    mod.max_memory_allocated = lambda device=None: state["peak"]
    mod.mem_get_info = lambda device=None: (60 << 30, 64 << 30)
    mod.manual_seed_all = lambda seed: None
    mod.get_rng_state = lambda device="npu": torch.zeros(16, dtype=torch.uint8)
    mod.set_rng_state = lambda new_state, device="npu": None
    mod.is_bf16_supported = lambda: True
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    mod._is_in_bad_fork = lambda: False
    mod.current_stream = lambda device=None: None
    torch._register_device_module("npu", mod)
    sys.modules["torch.npu"] = mod
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", lambda *a, **k: None, devices=["npu"])
    dist.Backend.default_device_backend_map["npu"] = "hccl"


if os.environ.get("LNPU_STUB_NPU_DEVICE") == "1":
    _install_device()
