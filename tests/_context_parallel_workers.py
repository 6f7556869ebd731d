"""Workers for tests/test_context_parallel.py: stock transformers decoders (their own causal-LM loss) and the example
GPT trained under `context_parallel_size`, against the same runs on one process.

Samples are fixed (sample ``i`` from seed ``i``, unshuffled): dp rank r of dp reads samples r, r + dp, ... of each
global batch, every cp rank of a dp group the same ones. Qwen3's labels ignore a run of tokens near the start, so
the cp ranks hold different numbers of counted tokens (the loss must still be averaged over every token)."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_npu
from examples.gpt.model import GPT, GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.memory import SavedActivations
from tests._model_zoo_workers import Losses, _world

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 16, 128
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, num_key_value_heads=2, use_cache=False)


class HFModule(L.LightningModule):
    """A user's module around a stock causal LM: the model computes its own loss from ``labels``."""

    def __init__(self, arch: str) -> None:
        super().__init__()
        import transformers as T

        T.logging.set_verbosity_error()
        config = {"llama": lambda: T.LlamaConfig(**DECODER),
                  "qwen3": lambda: T.Qwen3Config(head_dim=8, **DECODER)}[arch]()
        config._attn_implementation = "sdpa"
        self.model = {"llama": T.LlamaForCausalLM, "qwen3": T.Qwen3ForCausalLM}[arch](config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.01)


class GPTCase(GPTModule):
    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, learning_rate=1e-3)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # no throughput logging in the comparison
        pass


class TokenData(Dataset):
    def __init__(self, kind: str, size: int = 8 * GLOBAL_BATCH) -> None:
        self.kind, self.size = kind, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        if self.kind == "gpt":
            return tokens[:-1], tokens[1:]
        labels = tokens[:-1].clone()
        if self.kind == "qwen3":
            labels[1:1 + 3 + i % 4] = -100  # ignored tokens, mostly in rank 0's first chunk
        return {"input_ids": tokens[:-1], "labels": labels}


class PeakSaved(L.Callback):
    """The largest bytes autograd held for backward during a training step, on this rank."""

    def __init__(self) -> None:
        self.counter, self.peak = SavedActivations(), 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counter.start()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.peak = max(self.peak, self.counter.peak)
        self.counter.stop()


def build(kind: str) -> L.LightningModule:
    return GPTCase() if kind == "gpt" else HFModule(kind)


def fit(kind: str, strategy: dict[str, Any], steps: int = STEPS, save: Optional[str] = None,
        load: Optional[str] = None) -> dict[str, Any]:
    """`steps` steps of `kind` under `strategy`: the logged losses and the final full state."""
    world = _world()
    L.seed_everything(0, verbose=False)
    model = build(kind)
    strategy = NPUHybridStrategy(**strategy)
    cfg = strategy.parallel_config
    dp = world // (cfg.tensor_parallel_size * cfg.context_parallel_size * cfg.pipeline_parallel_size)
    losses, saved = Losses(), PeakSaved()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[losses, saved], num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
                        gradient_clip_val=0.5)
    loader = DataLoader(TokenData(kind), batch_size=GLOBAL_BATCH // dp, shuffle=False)
    lengths: set[int] = set()  # the sequence lengths the model's forward saw (under cp: this rank's chunks)

    def seen(module, args, kwargs):
        tokens = args[0] if args else kwargs.get("input_ids")
        if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
            lengths.add(tokens.shape[1])

    model.model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        trainer.fit(model, train_dataloaders=loader, ckpt_path=load)
    except Exception as err:  # noqa: BLE001 (a refusal is a result here)
        return {"error": f"{type(err).__name__}: {err}"}
    if save:
        trainer.save_checkpoint(save)
    return {"logged": losses.logged, "state": lightning_npu.full_state_dict(model), "saved_bytes": saved.peak,
            "lengths": sorted(lengths),
            "recompute": str(trainer.strategy.recompute_report)}


def run(cases: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Every case (model kind, strategy arguments) in turn, in one process group."""
    return {name: fit(kind, strategy) for name, (kind, strategy) in cases.items()}


def resume_across_cp(directory: str) -> dict[str, Any]:
    """2 steps of Llama at cp=2 saved as a sharded directory, resumed for the last at cp=1 x dp=2."""
    path = f"{directory}/cp2"
    first = fit("llama", {"context_parallel_size": 2, "save_distributed_checkpoint": True}, 2, save=path)
    second = fit("llama", {}, STEPS, load=path)
    return {"cp2": first.get("logged", first), "dp2 from cp2": second.get("logged", second)}


def refusals() -> dict[str, str]:
    """Models and inputs context parallelism cannot run, each with its error."""
    out = {}
    for name, make, data in [
        ("no position_ids", lambda: _NoPositions(), TokenData("gpt")),
        ("length", lambda: GPTCase(), _Short()),
    ]:
        trainer = L.Trainer(accelerator="cpu", devices=_world(), strategy=NPUHybridStrategy(context_parallel_size=2),
                            max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        try:
            trainer.fit(make(), DataLoader(data, batch_size=2))
            out[name] = "no error"
        except Exception as err:  # noqa: BLE001 (the refusal is the result)
            out[name] = f"{type(err).__name__}: {err}"
    return out


class _GPTWithoutPositions(GPT):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # a model that numbers its tokens itself
        return GPT.forward(self, idx)


class _NoPositions(GPTCase):
    def __init__(self) -> None:
        super().__init__()
        self.model.__class__ = _GPTWithoutPositions


class _Short(TokenData):
    def __init__(self) -> None:
        super().__init__("gpt")

    def __getitem__(self, i: int) -> Any:
        x, y = super().__getitem__(i)
        return x[:14], y[:14]


def ring_errors() -> dict[str, float]:
    """Ring attention on this launch's ranks (cp = world, fp64, grouped-query heads) against one SDPA over the whole
    sequence: the largest difference of the output and of dq, dk, dv, on CPU's flash kernel and the matmul form."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_npu.parallel.context_parallel import blockwise, ring
    from lightning_npu.parallel.context_parallel.layout import ChunkLayout

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    layout = ChunkLayout(cp, rank)
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, h, 8 * cp, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(whole[0], *(t.repeat_interleave(2, 1) for t in whole[1:]), is_causal=True
                                   ).backward(grad)
    split = lambda t: layout.split(t.transpose(1, 2)).transpose(1, 2).contiguous()  # noqa: E731
    out = {}
    for form, fused in (("flash", blockwise.supported), ("matmul", lambda q: False)):
        local = [split(t).requires_grad_() for t in (q, k, v)]
        original, ring.blockwise.supported = ring.blockwise.supported, fused
        try:
            o = ring.RingAttention.apply(*local, ring.Ring(dist.group.WORLD),
                                         tuple(layout.chunks(r) for r in range(cp)), None, 2)
            o.backward(split(grad))
        finally:
            ring.blockwise.supported = original
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        out[form] = max([(o - split(ref)).abs().max().item()]
                        + [(t.grad - split(w.grad)).abs().max().item() for t, w in zip(local, whole)])
    return out


def two_process(directory: str) -> dict[str, Any]:
    """The 2-process launch: cp=2 for Llama (ZeRO-1), Qwen3 and the GPT (ZeRO-0; also all-gathered K/V), both also
    with full activation checkpointing, the resume, the refusals, ring attention against one SDPA."""
    out = run({"llama cp2": ("llama", {"context_parallel_size": 2}),
               "qwen3 cp2": ("qwen3", {"context_parallel_size": 2, "zero_stage": 0}),
               "gpt cp2": ("gpt", {"context_parallel_size": 2, "zero_stage": 0}),
               "gpt cp2 allgather": ("gpt", {"context_parallel_size": 2, "zero_stage": 0,
                                             "context_parallel_attention": "allgather"}),
               # full recompute: attention re-runs in backward with the step's split (the mode re-entered)
               "gpt cp2 ac": ("gpt", {"context_parallel_size": 2, "zero_stage": 0, "activation_checkpointing": "full"}),
               "llama cp2 ac": ("llama", {"context_parallel_size": 2, "activation_checkpointing": "full"})})
    out["resume"] = resume_across_cp(directory)
    out["refusals"] = refusals()
    out["ring"] = ring_errors()
    return out


def four_process() -> dict[str, Any]:
    """The 4-process launch: the GPT at cp2 x dp2 x ZeRO-3 and at pp2 x cp2 (ZeRO-1, 2 micro-batches), Llama at
    cp2 x tp2 (ZeRO-0), ring attention at cp=4."""
    out = run({"gpt cp2 dp2 zero3": ("gpt", {"context_parallel_size": 2, "zero_stage": 3}),
               "gpt pp2 cp2": ("gpt", {"context_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batches": 2}),
               "llama cp2 tp2": ("llama", {"context_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 0})})
    out["ring"] = ring_errors()
    return out
