"""What a checkpoint save or load raises; each message names the file."""

from __future__ import annotations


class CheckpointSaveError(RuntimeError):
    """Some rank failed to write its shards; nothing was committed."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file needs code or types that safe loading refuses; names the file and what was refused."""


class CheckpointMismatchError(RuntimeError):
    """The checkpoint's tensors do not fit the model/optimizer being restored; names the keys."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint file could not be read (truncated, corrupt, missing); names the file."""
