"""The fused C++ kernels against fp64 eager references (lightning_npu.ops.reference).

Every case runs the real kernel (the extension is built on first use); the error metric is
the norm-wise relative error, with a tiny absolute floor for gradients that are exactly zero
(e.g. a LayerNorm weight over a hidden size of 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_npu.ops import extension, functional as fx, library, reference as ref

pytestmark = pytest.mark.timeout(300)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HIDDEN = (1, 7, 768, 4097)


@pytest.fixture(scope="module", autouse=True)
def built():
    if extension.load() is None:  # only acceptable on a machine without a compiler
        pytest.skip(f"C++ kernels could not be built here: {extension.load_error()}")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    floor = 1e-6 * max(want.numel(), 1) ** 0.5
    return ((got - want).norm() / max(want.norm().item(), floor)).item()


def make(shape, dtype, noncontig: bool, scale: float = 1.0) -> torch.Tensor:
    """A leaf tensor; non-contiguous ones are transposed views of a differently laid-out buffer."""
    if noncontig and len(shape) >= 2:
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=torch.float64) * scale
        t = base.to(dtype).transpose(-1, -2)
        assert not t.is_contiguous() or 1 in shape[-2:]
    else:
        t = (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)
    return t.requires_grad_()


def as_ref(*ts):
    return [None if t is None else t.detach().double().requires_grad_() for t in ts]


def check(outs, ref_outs, grads, ref_grads, dtype, what):
    tol = TOL[dtype]
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == dtype, (what, i, o.dtype)
        assert rel_err(o, r) <= tol, (what, "output", i, rel_err(o, r))
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_err(g, r) <= tol, (what, "grad", i, rel_err(g, r))


def rows_for(h):
    return (2, 3, h) if h < 1000 else (3, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("noncontig", [False, True])
def test_bias_gelu(dtype, approximate, noncontig):
    torch.manual_seed(0)
    for h in HIDDEN:
        x, b = make(rows_for(h), dtype, noncontig, 2.0), make((h,), dtype, False)
        y = fx.bias_gelu(x, b, approximate)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, b), g)
        xr, br = as_ref(x, b)
        yr = ref.bias_gelu(xr, br, approximate)
        check([y], [yr], grads, torch.autograd.grad(yr, (xr, br), g.double()), dtype, f"gelu h={h}")
        y0 = fx.bias_gelu(x, None, approximate)  # no-bias (flat) path
        assert rel_err(y0, ref.bias_gelu(xr, None, approximate)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("noncontig", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_add_norm(dtype, noncontig, rms):
    torch.manual_seed(1)
    for h in HIDDEN:
        shape = rows_for(h)
        x, r = make(shape, dtype, noncontig), make(shape, dtype, False, 3.0)
        w = (torch.randn(h) * 0.5 + 1).requires_grad_()
        b = None if rms else torch.randn(h).requires_grad_()
        if rms:
            y, s = fx.add_rms_norm(x, r, w, 1e-6)
        else:
            y, s = fx.add_layer_norm(x, r, w, b, 1e-5)
        gy, gs = torch.randn_like(y), torch.randn_like(s)
        leaves = [t for t in (x, r, w, b) if t is not None]
        grads = torch.autograd.grad((y, s), leaves, (gy, gs))
        xr, rr, wr, brf = as_ref(x, r, w, b)
        # reference normalises the sum rounded to the activation dtype, as the unfused add would
        sr = (x.detach() + r.detach()).double() if dtype != torch.float32 else None
        if rms:
            yr, hr = ref.add_rms_norm(xr, rr, wr, 1e-6)
        else:
            yr, hr = ref.add_layer_norm(xr, rr, wr, brf, 1e-5)
        ref_leaves = [t for t in (xr, rr, wr, brf) if t is not None]
        ref_grads = torch.autograd.grad((yr, hr), ref_leaves, (gy.double(), gs.double()))
        check([y, s], [yr, hr if sr is None else sr], grads, ref_grads, dtype, f"norm rms={rms} h={h}")
        # without residual: plain norm, and the returned "sum" is the input itself
        y1 = fx.rms_norm(x, w, 1e-6) if rms else fx.layer_norm(x, w, b, 1e-5)
        y1r = ref.add_rms_norm(xr, None, wr, 1e-6)[0] if rms else ref.add_layer_norm(xr, None, wr, brf, 1e-5)[0]
        g1 = torch.autograd.grad(y1, leaves[:1] + leaves[2:], gy)
        g1r = torch.autograd.grad(y1r, ref_leaves[:1] + ref_leaves[2:], gy.double())
        check([y1], [y1r], g1, g1r, dtype, f"norm(no residual) rms={rms} h={h}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("noncontig", [False, True])
def test_scale_mask_softmax(dtype, noncontig):
    torch.manual_seed(2)
    for tq, tk in ((1, 1), (7, 7), (5, 9), (64, 64), (3, 4097)):
        s = make((2, 3, tq, tk), dtype, noncontig, 3.0)
        pad = torch.rand(2, 1, 1, tk) < 0.3
        pad[..., -1] = False  # keep one key visible for every query (eager gives NaN otherwise)
        full = torch.rand(2, 3, tq, tk) < 0.2
        full[..., -1] = False
        for causal, mask in ((False, None), (True, None), (False, pad), (True, pad), (False, full)):
            if causal and mask is not None:
                mask = mask.clone()
                mask[..., : tk - tq + 1] = False  # the diagonal stays visible
            y = fx.scale_mask_softmax(s, 0.125, causal, mask)
            g = torch.randn_like(y)
            (gs,) = torch.autograd.grad(y, s, g)
            (sr,) = as_ref(s)
            yr = ref.scale_mask_softmax(sr, 0.125, causal, mask)
            check([y], [yr], [gs], torch.autograd.grad(yr, sr, g.double()), dtype, f"softmax {tq}x{tk} {causal}")


def test_softmax_fully_masked_row_is_zero():
    s = torch.randn(1, 1, 2, 4, requires_grad=True)
    mask = torch.tensor([[True] * 4, [False, True, True, False]]).view(1, 1, 2, 4)
    y = fx.scale_mask_softmax(s, 1.0, False, mask)
    assert torch.equal(y[0, 0, 0], torch.zeros(4))
    (g,) = torch.autograd.grad(y.sum(), s)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("noncontig", [False, True])
def test_swiglu(dtype, noncontig):
    torch.manual_seed(3)
    for h in HIDDEN:
        gate, up = make(rows_for(h), dtype, noncontig, 3.0), make(rows_for(h), dtype, False)
        y = fx.swiglu(gate, up)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, (gate, up), g)
        gr, ur = as_ref(gate, up)
        yr = ref.swiglu(gr, ur)
        check([y], [yr], grads, torch.autograd.grad(yr, (gr, ur), g.double()), dtype, f"swiglu h={h}")
    # the common case: gate and up are halves of one projection (non-contiguous chunks)
    both = torch.randn(4, 10, dtype=dtype, requires_grad=True)
    a, b = both.chunk(2, dim=-1)
    assert rel_err(fx.swiglu(a, b), ref.swiglu(a.double(), b.double())) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_dropout_add(dtype):
    torch.manual_seed(4)
    p = 0.25
    for h in HIDDEN:
        shape = rows_for(h)
        x, b, r = make(shape, dtype, True), make((h,), dtype, False), make(shape, dtype, False)
        torch.manual_seed(123)
        y = fx.bias_dropout_add(x, b, r, p, training=True)
        # recover the kernel's mask: same seed, x = 1, no bias, residual = 0 -> y = mask / (1 - p)
        torch.manual_seed(123)
        probe = fx.bias_dropout_add(torch.ones(shape, dtype=dtype), None, torch.zeros(shape, dtype=dtype), p)
        mask = (probe != 0).double()
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, b, r), g)
        xr, br, rr = as_ref(x, b, r)
        yr = ref.bias_dropout_add(xr, br, rr, p, mask=mask)
        check([y], [yr], grads, torch.autograd.grad(yr, (xr, br, rr), g.double()), dtype, f"dropout h={h}")
    big = fx.bias_dropout_add(torch.ones(256, 1024), None, torch.zeros(256, 1024), p)
    kept = (big != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.01, kept
    torch.manual_seed(7)
    a = fx.bias_dropout_add(torch.ones(8, 64), None, torch.zeros(8, 64), 0.5)
    torch.manual_seed(7)
    assert torch.equal(a, fx.bias_dropout_add(torch.ones(8, 64), None, torch.zeros(8, 64), 0.5))
    assert not torch.equal(a, fx.bias_dropout_add(torch.ones(8, 64), None, torch.zeros(8, 64), 0.5))
    # eval mode / p=0 are exact adds
    assert torch.equal(fx.bias_dropout_add(a, None, a, 0.5, training=False), a + a)


def test_gradcheck_fp64():
    """The kernels have a double instantiation, so autograd's numerical check runs on them."""
    torch.manual_seed(5)
    d = dict(dtype=torch.float64, requires_grad=True)
    x, r, b = torch.randn(3, 7, **d), torch.randn(3, 7, **d), torch.randn(7, **d)
    w = (torch.rand(7, **{**d, "requires_grad": False}) + 0.5).requires_grad_()
    gc = torch.autograd.gradcheck
    assert gc(lambda x, b: fx.bias_gelu(x, b, "none"), (x, b))
    assert gc(lambda x, b: fx.bias_gelu(x, b, "tanh"), (x, b))
    assert gc(lambda x, r, w, b: fx.add_layer_norm(x, r, w, b, 1e-5), (x, r, w, b))
    assert gc(lambda x, r, w: fx.add_rms_norm(x, r, w, 1e-6), (x, r, w))
    assert gc(fx.swiglu, (x, r))
    s = torch.randn(2, 5, 5, **d)
    pad = torch.tensor([False, False, True, False, False]).view(1, 1, 5)
    assert gc(lambda s: fx.scale_mask_softmax(s, 0.7, True, None), (s,))
    assert gc(lambda s: fx.scale_mask_softmax(s, 0.7, False, pad), (s,))
    seed = 99

    def dropped(x, b, r):
        torch.manual_seed(seed)  # same mask on every evaluation
        return fx.bias_dropout_add(x, b, r, 0.3)

    assert gc(dropped, (x, b, r))


def test_custom_ops_opcheck():
    """Schema, fake kernels and autograd registration agree with the real kernels."""
    x, b = torch.randn(4, 9, requires_grad=True), torch.randn(9, requires_grad=True)
    torch.library.opcheck(library.bias_gelu, (x, b, True))
    torch.library.opcheck(library.add_norm, (x, x.detach().clone(), torch.ones(9), torch.zeros(9), 1e-5, False))
    torch.library.opcheck(library.add_norm, (x, None, torch.ones(9), None, 1e-5, True))
    torch.library.opcheck(library.scale_mask_softmax, (torch.randn(2, 4, 4, requires_grad=True), 0.5, True, None))
    torch.library.opcheck(library.swiglu, (x, torch.randn(4, 9, requires_grad=True)))
    torch.library.opcheck(library.bias_dropout_add, (x, b, torch.randn(4, 9), 0.1, torch.tensor(3)))


def test_torch_compile_fullgraph():
    """Custom ops are opaque to dynamo: no graph break, same values and gradients as eager."""

    def block(x, r, w, b, fc_b):
        y, h = fx.add_layer_norm(x, r, w, b, 1e-5)
        a = fx.bias_gelu(y, fc_b, "tanh")
        s = fx.scale_mask_softmax(a.view(2, 4, 16, 16), 0.5, causal=True)
        return h.sum() + (s * a.view(2, 4, 16, 16)).sum() + fx.swiglu(a, y).sum()

    torch.manual_seed(6)
    args = [torch.randn(2, 32, 32, requires_grad=True) for _ in range(2)] + [
        torch.randn(32, requires_grad=True) for _ in range(3)
    ]
    eager = block(*args)
    ge = torch.autograd.grad(eager, args)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(*args)
    gc_ = torch.autograd.grad(compiled, args)
    assert rel_err(compiled, eager) <= 1e-6
    for a, b in zip(gc_, ge):
        assert rel_err(a, b) <= 1e-6


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    """No compiler: one warning line, the eager path, and identical results."""
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from lightning_npu.ops import functional as fx, extension, reference as ref\n"
        "    x = torch.randn(3, 5)\n"
        "    y = fx.layer_norm(x, None, None)\n"
        "    assert fx.backend_for(x) == 'eager'\n"
        "    fx.bias_gelu(x, None)\n"
        "msgs = [str(m.message) for m in w if 'lightning_npu' in str(m.message)]\n"
        "assert len(msgs) == 1 and '\\n' not in msgs[0], msgs\n"
        "assert torch.equal(y, ref.add_layer_norm(x, None, None, None, 1e-5)[0])\n"
        "print(msgs[0])\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "eager fallbacks" in out.stdout


def test_extension_cache_refuses_a_directory_others_can_write(tmp_path, monkeypatch):
    """A cache dir that is group/world-writable or owned by another user is refused before anything is loaded."""
    monkeypatch.setattr(extension, "_state", {})
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(shared))
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)
    with pytest.raises(extension.UnsafeCacheError, match=rf"{shared}.*writable.*chmod go-w"):
        extension.load()
    with pytest.raises(extension.UnsafeCacheError):  # refused every time, never cached as "no extension"
        extension.available()
    shared.chmod(0o770)  # group-writable is refused too
    with pytest.raises(extension.UnsafeCacheError, match="writable by its group"):
        extension.load()
    # owned by someone else: as root, give it away; otherwise any root-owned directory will do
    if os.geteuid() == 0:
        shared.chmod(0o755)
        os.chown(shared, 65534, 65534)
        other = shared
    else:
        other = Path("/")
    with pytest.raises(extension.UnsafeCacheError, match=rf"{other} is owned by uid \d+, not by this user"):
        extension.check_private_dir(other)
    # a private directory (created 0700 when missing) passes; its world-writable parent needs the sticky bit
    private = tmp_path / "private" / "ops"
    extension._private_cache(private)
    assert (private.stat().st_mode & 0o777) == 0o700
    (tmp_path / "private").chmod(0o777)
    with pytest.raises(extension.UnsafeCacheError, match="parent .* without the sticky bit"):
        extension.check_private_dir(private)
    (tmp_path / "private").chmod(0o1777)
    extension.check_private_dir(private)
