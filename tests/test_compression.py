"""Gradient compressors (`lightning_npu.parallel.data_parallel.compression`): bytes on the wire and error feedback, on 2 processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_npu.launch import spawn
from lightning_npu.parallel.data_parallel.compression import Compressor
from lightning_npu.parallel.data_parallel.compression_spec import CompressionSpec, parse_compression, spec_for
from lightning_npu.parallel.errors import CompressionConfigError

N, STEPS = 100_003, 6  # an odd size: chunks and bit packing pad
BOUNDS = {"bf16": 0.52, "int8": 0.27, "topk": 0.21, "onebit": 0.05}


class _Wire:
    """Bytes this rank hands to torch.distributed collectives (what it puts on the wire)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._orig = {}

    def __enter__(self) -> "_Wire":
        for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single"):
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def counted(*args, _fn=fn, _name=name, **kwargs):
                tensor = args[0] if _name == "all_reduce" else args[1]
                self.bytes += tensor.numel() * tensor.element_size()
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _run(spec: CompressionSpec) -> dict:
    rank = dist.get_rank()
    compressor = Compressor(spec)
    true_total = torch.zeros(N)
    reduced_total = torch.zeros(N)
    wire = []
    for step in range(STEPS):
        g = torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))
        both = [torch.randn(N, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(2)]
        true_total += both[0] + both[1]
        flat = g.clone()
        # PowerSGD sees the bucket as a 301 x 331 weight and a bias (what the other modes ignore)
        with _Wire() as w:
            compressor.sum(flat, None, "bucket0", params=[torch.empty(301, 331), torch.empty(372)])
        wire.append(w.bytes)
        reduced_total += flat
    residual = compressor.residuals.get("bucket0", torch.zeros(N)).clone()
    dist.all_reduce(residual)
    return {"wire": wire, "true": true_total, "reduced": reduced_total, "residuals": residual,
            "last": flat, "state": compressor.state_dict()}


SHAPES = [(7, 12), (12,), (9, 5, 2), (16, 16)]  # odd rows: ZeRO-1's two parts pad them


def _powersgd_rank1() -> dict:
    """Rank-1 gradients on every rank: PowerSGD, factorising each matrix on its own, returns their exact sum, in one
    part (DDP, pipeline buckets) and in ZeRO-1's two rank-major zero-padded parts; one matrix over the whole bucket
    (the whole bucket as one matrix) cannot. Returns the largest error per layout."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    factors = [(torch.randn(s[0], generator=gen), torch.randn(torch.Size(s[1:]).numel(), generator=gen)) for s in SHAPES]

    def grads(r: int) -> list[torch.Tensor]:  # matrices rank 1, the bias anything
        return [(r + 1) * torch.outer(u, v).view(s) if len(s) > 1 else torch.full(s, float(r)) for (u, v), s in
                zip(factors, SHAPES)]

    params = [torch.empty(s) for s in SHAPES]
    errors = {}
    for name, parts in (("one part", 1), ("zero1 parts", 2), ("one matrix", 1)):
        def bucket(gs: list[torch.Tensor]) -> torch.Tensor:
            rows = sum(-(-g.shape[0] // parts) * (g.numel() // g.shape[0]) for g in gs)
            out = torch.empty(parts, rows)
            torch._chunk_cat(gs, dim=0, num_chunks=parts, out=out)
            return out.view(-1)

        flat, want = bucket(grads(rank)), bucket([a + b for a, b in zip(grads(0), grads(1))])
        compressor = Compressor(CompressionSpec("powersgd", rank=1))
        whole = [torch.empty(17, flat.numel() // 17)]  # (the bucket's 442 values: 17 x 26)
        compressor.sum(flat, None, "b", params=whole if name == "one matrix" else params, parts=parts)
        errors[name] = float((flat - want).abs().max() / want.abs().max())
    return errors


def _all_modes() -> dict:
    dist.init_process_group("gloo")  # (spawn sets the rendezvous environment)
    specs = {
        "bf16": CompressionSpec("bf16"),
        "int8": CompressionSpec("int8"),
        "topk": CompressionSpec("topk", ratio=0.1),
        "topk_no_feedback": CompressionSpec("topk", ratio=0.1, error_feedback=False),
        "onebit": CompressionSpec("onebit", warmup_steps=2),
        "powersgd": CompressionSpec("powersgd", rank=4),
    }
    try:
        return {**{name: _run(spec) for name, spec in specs.items()}, "powersgd_rank1": _powersgd_rank1()}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    return spawn(_all_modes, 2)


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_bytes_on_the_wire(ranks, mode):
    fp32 = N * 4
    for got in ranks:
        wire = got[mode]["wire"]
        after_warmup = wire[2:] if mode == "onebit" else wire
        assert all(b / fp32 <= BOUNDS[mode] for b in after_warmup), (mode, [b / fp32 for b in wire])
        if mode == "onebit":
            assert wire[0] == fp32  # the warm-up steps are plain fp32


@pytest.mark.parametrize("mode", ["int8", "topk", "onebit", "powersgd"])
def test_error_feedback_loses_nothing(ranks, mode):
    """Over every step, what was reduced plus what the ranks still hold back equals the true sum."""
    for got in ranks:
        r = got[mode]
        torch.testing.assert_close(r["reduced"] + r["residuals"], r["true"], rtol=0, atol=1e-3)
    no_feedback = ranks[0]["topk_no_feedback"]
    assert (no_feedback["reduced"] - no_feedback["true"]).norm() > 10 * (
        ranks[0]["topk"]["reduced"] + ranks[0]["topk"]["residuals"] - ranks[0]["topk"]["true"]).norm()


def test_powersgd_factorises_each_matrix(ranks):
    errors = ranks[0]["powersgd_rank1"]
    assert errors["one part"] < 1e-5 and errors["zero1 parts"] < 1e-5, errors
    assert errors["one matrix"] > 1e-2, errors  # one matrix over mixed parameters has no rank-1 structure


def test_every_rank_gets_the_same_sum(ranks):
    for mode in (m for m in ranks[0] if m != "powersgd_rank1"):
        torch.testing.assert_close(ranks[0][mode]["last"], ranks[1][mode]["last"], rtol=0, atol=0, msg=mode)
    bf16 = ranks[0]["bf16"]  # bf16: the sum itself, to bf16 precision
    torch.testing.assert_close(bf16["reduced"], bf16["true"], rtol=0, atol=0.1)


def test_state_resets_when_dp_changes(ranks):
    state = ranks[0]["topk"]["state"]
    same, other = Compressor(CompressionSpec("topk")), Compressor(CompressionSpec("topk"))
    assert same.load_state_dict(state, world=2) and same.residuals["bucket0"].shape == (N,)
    assert not other.load_state_dict(state, world=4) and other.residuals == {}
    assert other.steps == {"bucket0": STEPS}  # the warm-up count carries over


@pytest.mark.parametrize("value, match", [
    ("gzip", "mode 'gzip' is unknown"),
    ({"mode": "topk", "ratio": 0}, r"ratio=0 must be in \(0, 1\]"),
    ({"mode": "topk", "ratio": 1.5}, r"ratio=1.5 must be in \(0, 1\]"),
    ({"mode": "onebit", "warmup_steps": -1}, "warmup_steps=-1"),
    ({"mode": "topk", "k": 3}, r"unknown options \['k'\]"),
    (3, "must be None, a mode name"),
    ({"mode": "topk", "frozen_variance": True}, r"frozen_variance=True \(1-bit Adam\).*warmup_steps=0"),
    ({"mode": "bf16", "warmup_steps": 5, "frozen_variance": True}, "needs a lossy mode"),
    ({"mode": "onebit", "warmup_steps": 5, "frozen_variance": True, "error_feedback": False}, "error feedback"),
    ({"mode": "onebit", "frozen_variance": 1}, "frozen_variance=1 must be True or False"),
])
def test_bad_values(value, match):
    with pytest.raises(CompressionConfigError, match=match):
        parse_compression(value)


def test_module_globs():
    parsed = parse_compression({"text.*": "onebit", "vision.*": None, "*": {"mode": "topk", "ratio": 0.05}})
    assert spec_for(parsed, "text.encoder.0").mode == "onebit"
    assert spec_for(parsed, "vision.patch") is None
    assert spec_for(parsed, "head").ratio == 0.05
    assert parse_compression("bf16") == CompressionSpec("bf16")


def test_glob_precedence_and_names():
    """The first glob in the dict's order that matches a parameter's module name or its full name wins."""
    parsed = parse_compression({"*.bias": None, "text.*": "int8", "text": "topk", "*": "bf16"})
    assert spec_for(parsed, "text.encoder.0", "text.encoder.0.weight").mode == "int8"
    assert spec_for(parsed, "text.encoder.0", "text.encoder.0.bias") is None  # matched by its full name, first
    assert spec_for(parsed, "text", "text.weight").mode == "int8"  # 'text.*' matches the full name 'text.weight'
    assert spec_for(parsed, "", "scale").mode == "bf16"  # a parameter of the root module: module name ''


def _two_branches() -> torch.nn.Module:
    model = torch.nn.Module()
    model.text = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model.vision = torch.nn.Linear(4, 2)
    return model


def test_resolve_and_segments():
    model = _two_branches()
    compressor = Compressor(parse_compression({"vision.*": None, "text.1": "topk", "text.*": "int8"}))
    # a glob with None matches too; "vision.*" matches the full names "vision.weight" (module name: "vision")
    assert compressor.resolve(model.named_parameters()) == {"vision.*", "text.1", "text.*"}
    assert compressor.spec_of(model.text[0].weight).mode == "int8"
    assert compressor.spec_of(model.text[1].bias).mode == "topk"
    assert compressor.spec_of(model.vision.weight) is None
    assert compressor.spec_of(torch.nn.Parameter(torch.zeros(1))) is None  # never resolved: uncompressed
    # a DDP-like bucket order with the globs interleaved: one segment per glob, non-contiguous ranges kept apart
    params = [model.vision.bias, model.text[1].weight, model.text[0].bias, model.vision.weight, model.text[0].weight]
    segments = compressor.segments(params)
    assert [(g, None if s is None else s.mode, r) for g, s, r in segments] == [
        ("none", None, [(0, 2), (26, 34)]), ("g1", "topk", [(2, 18)]), ("g2", "int8", [(18, 26), (34, 66)])]
    assert Compressor(CompressionSpec("int8")).resolve(model.named_parameters()) == set()  # one mode: nothing to do


@pytest.mark.parametrize("value, match", [
    ({"text.*": "zip"}, r"`gradient_compression\['text.\*'\]`: .*mode 'zip' is unknown"),
    ({"text.*": {"ratio": 0.1}}, r"`gradient_compression\['text.\*'\]=\{'ratio': 0.1\}` must be None \(uncompressed\), a mode name"),
    ({"text.*": {"mode": "topk", "ratio": 0}}, r"`gradient_compression\['text.\*'\]`: .*ratio=0"),
])
def test_bad_glob_values_name_the_glob(value, match):
    with pytest.raises(CompressionConfigError, match=match):
        parse_compression(value)


# ---- 1-bit Adam (frozen_variance): the optimizer side ----------------------------------------------------------
def test_frozen_variance_refuses_other_optimizers_and_zero1():
    from lightning_npu.parallel.config import ParallelConfig, ParallelConfigError
    from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer

    spec = CompressionSpec("topk", warmup_steps=10, frozen_variance=True)
    sgd = MixedPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.raises(CompressionConfigError, match="torch.optim.Adam or AdamW.*got SGD"):
        Compressor(spec).bind_optimizers([sgd])
    with pytest.raises(CompressionConfigError, match="got SGD"):  # a branch's spec on the top level's compressor
        Compressor(CompressionSpec("int8"), also=[spec]).bind_optimizers([sgd])
    amsgrad = MixedPrecisionOptimizer(torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True))
    with pytest.raises(CompressionConfigError, match="amsgrad"):
        Compressor(spec).bind_optimizers([amsgrad])
    with pytest.raises(ParallelConfigError, match="zero_stage=1.*1-bit Adam"):
        ParallelConfig(zero_stage=1, gradient_compression={"mode": "topk", "warmup_steps": 10, "frozen_variance": True})


def test_gradient_feedback_under_adam_warns():
    """topk/onebit/powersgd with gradient error feedback barely train under Adam (+93% to +547% on the example GPT):
    say so at setup and name 1-bit Adam; other optimizers, 1-bit Adam and int8 stay quiet."""
    import warnings

    from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer

    def wrapped(kind):
        return MixedPrecisionOptimizer(kind([torch.nn.Parameter(torch.zeros(2))], lr=0.1))

    with pytest.warns(UserWarning, match=r"topk with error feedback on the gradients converges poorly under AdamW.*"
                                         r"frozen_variance=True"):
        Compressor(parse_compression("topk")).bind_optimizers([wrapped(torch.optim.AdamW)])
    with pytest.warns(UserWarning, match="onebit/powersgd .* under Adam:"):
        Compressor(parse_compression({"a.*": "onebit", "b.*": {"mode": "powersgd", "rank": 2}, "c.*": "int8"})
                   ).bind_optimizers([wrapped(torch.optim.Adam)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Compressor(parse_compression("topk")).bind_optimizers([wrapped(torch.optim.SGD)])
        Compressor(parse_compression("int8")).bind_optimizers([wrapped(torch.optim.AdamW)])
        Compressor(parse_compression({"mode": "topk", "warmup_steps": 5, "frozen_variance": True})
                   ).bind_optimizers([wrapped(torch.optim.AdamW)])


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_adam_step_is_torchs_with_the_variance_frozen(kind):
    """`onebit_adam.FrozenVarianceAdam.step` steps like torch's Adam/AdamW (weight decay included); the parameters whose momentum
    was sent compressed keep their variance, bias-corrected for the warm-up's steps."""
    from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer

    torch.manual_seed(0)
    make = lambda: [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]  # noqa: E731
    ours, ref = make(), make()
    for a, b in zip(ours, ref):
        b.data.copy_(a.data)
    opt_cls = getattr(torch.optim, kind)
    options = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)
    opt, ref_opt = opt_cls(ours, **options), opt_cls(ref, **options)
    wrapper = MixedPrecisionOptimizer(opt)
    compressor = Compressor(CompressionSpec("topk", warmup_steps=3, frozen_variance=True))
    compressor.bind_optimizers([wrapper])
    assert wrapper.step_override == compressor.adam.step
    for step in range(5):
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step >= 3:  # as `Compressor.sum` records it for a compressed bucket holding the first parameter
            compressor.adam._frozen_now[id(ours[0])] = 3
            variance = opt.state[ours[0]]["exp_avg_sq"].clone()
        wrapper._step_main_params()
        ref_opt.step()
        torch.testing.assert_close(ours[1], ref[1])  # never frozen: torch's step
        if step < 3:
            torch.testing.assert_close(ours[0], ref[0])
        else:
            assert torch.equal(opt.state[ours[0]]["exp_avg_sq"], variance)
            if step == 3:  # the same parameters before this step: the same momentum (Adam's includes weight decay)
                torch.testing.assert_close(opt.state[ours[0]]["exp_avg"], ref_opt.state[ref[0]]["exp_avg"])
    assert float(opt.state[ours[0]]["step"]) == 5 and compressor.adam._frozen_now == {}


def test_one_bit_adam_finds_a_group_added_while_training():
    """Lightning's `BaseFinetuning` adds groups after the optimizers are bound: their momentum is found (and a
    resume's `load_state_dict`, which replaces the group dicts, keeps each parameter's betas)."""
    from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer

    first, later = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    wrapper = MixedPrecisionOptimizer(torch.optim.Adam([first], betas=(0.9, 0.99)))
    compressor = Compressor(CompressionSpec("onebit", warmup_steps=1, frozen_variance=True))
    compressor.bind_optimizers([wrapper])
    wrapper.add_param_group({"params": [later], "betas": (0.5, 0.99)})
    wrapper.optimizer.state[later].update(step=torch.tensor(1.0), exp_avg=torch.full((2,), 2.0),
                                          exp_avg_sq=torch.ones(2))
    wrapper.optimizer.load_state_dict(wrapper.optimizer.state_dict())
    m, beta1 = compressor.adam.momentum(torch.zeros(5), 1, [first, later], 1)
    assert m.tolist() == [0, 0, 0, 2, 2] and beta1.tolist() == pytest.approx([0.9] * 3 + [0.5] * 2)
