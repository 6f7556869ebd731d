"""Which tokens a cp rank keeps, and the batch split that gives them to it.

A causal mask makes late tokens cost more than early ones, so a contiguous split would leave the last rank with
most of the work. The sequence is cut into 2·cp chunks and rank i keeps chunks i and 2·cp−1−i (torchtitan's and
Megatron's load balancing): every rank then attends over the same number of (query, key) pairs.

Labels under the key ``"labels"`` (the transformers convention: not yet shifted) are shifted before the split, so
that a chunk's last token is trained on the next chunk's first one; the model is then handed them as
``shift_labels``. Other tensors (a GPT-style ``(inputs, targets)`` pair, already shifted) are split as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ChunkLayout:
    cp: int
    rank: int

    def check_length(self, seq_len: int) -> None:
        if seq_len % (2 * self.cp):
            raise ValueError(
                f"`context_parallel_size={self.cp}` splits each sequence into 2 x {self.cp} = {2 * self.cp} equal "
                f"chunks, but the batch's sequence length is {seq_len}; make it a multiple of {2 * self.cp} (pad or "
                "choose the block size), or change context_parallel_size.")

    def chunks(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.cp - 1 - rank

    def positions(self, seq_len: int, device: Any, rank: int | None = None) -> torch.Tensor:
        """The global position ids of `rank`'s tokens (this rank's by default), in the order it holds them."""
        size = seq_len // (2 * self.cp)
        first, second = self.chunks(self.rank if rank is None else rank)
        return torch.cat([torch.arange(first * size, (first + 1) * size, device=device),
                          torch.arange(second * size, (second + 1) * size, device=device)])

    def gathered_positions(self, seq_len: int, device: Any) -> torch.Tensor:
        """Positions of the keys as an all-gather over cp concatenates them (rank after rank)."""
        return torch.cat([self.positions(seq_len, device, r) for r in range(self.cp)])

    def split(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks of dim 1 (the sequence)."""
        b, s = tensor.shape[:2]
        self.check_length(s)
        chunked = tensor.reshape(b, 2 * self.cp, s // (2 * self.cp), *tensor.shape[2:])
        index = torch.tensor(self.chunks(self.rank), device=tensor.device)
        return chunked.index_select(1, index).reshape(b, -1, *tensor.shape[2:])


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels[:, 1:]`` with an ignored last position: what transformers' causal-LM loss compares logits with."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def sequence_length(batch: Any) -> int | None:
    """The sequence length: dim 1 of the batch's first tensor with two or more dims."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[1] if batch.dim() >= 2 else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        s = sequence_length(v)
        if s is not None:
            return s
    return None


def split_batch(batch: Any, layout: ChunkLayout) -> tuple[Any, int]:
    """The batch with every tensor of shape ``[B, S, ...]`` cut to this rank's chunks; and S."""
    seq_len = sequence_length(batch)
    if seq_len is None:
        raise ValueError("`context_parallel_size>1` splits the batch's sequences, but the batch holds no tensor of "
                         "shape [batch, sequence, ...]; pass token tensors, or set context_parallel_size=1.")
    layout.check_length(seq_len)

    def visit(value: Any, key: Any = None) -> Any:
        if isinstance(value, torch.Tensor):
            if key == "attention_mask" and not bool(value.all()):
                raise ValueError(
                    "`context_parallel_size>1` does not support padding masks (the batch's `attention_mask` masks "
                    "some tokens); pack the sequences to full length, or set context_parallel_size=1.")
            if key == "labels" and value.dim() >= 2:
                value = shift_labels(value)
            return layout.split(value) if value.dim() >= 2 and value.shape[1] == seq_len else value
        if isinstance(value, dict):
            return type(value)({k: visit(v, k) for k, v in value.items()})
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(visit(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(visit(v) for v in value)
        return value

    return visit(batch), seq_len
