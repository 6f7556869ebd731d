"""`lightning-npu` command line, built on LightningCLI.

``fit|validate|test|predict`` are LightningCLI's own subcommands with the ``npu_hybrid``
strategy registered. The current directory is importable (as with ``python -m``) so that a
config's ``class_path`` can name modules of the user's project, e.g. ``examples.gpt.model.GPTModule``.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import lightning_npu  # noqa: F401  (registers "npu" and "npu_hybrid")


def _lightning_cli(args: list[str]) -> None:
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


def convert_checkpoint(args: list[str]) -> None:
    """`lightning-npu convert-checkpoint SRC DST`: a sharded checkpoint directory -> one full state-dict file."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="lightning-npu convert-checkpoint",
        description="Consolidate a lightning-npu sharded (DCP) checkpoint, saved under any tp/dp/zero layout, into "
        "a single file of full model tensors: safetensors if DST ends in .safetensors, else a torch file "
        "(a plain dict of tensors, loadable with torch.load(..., weights_only=True)).",
    )
    parser.add_argument("src", help="checkpoint directory (e.g. a ModelCheckpoint output 'epoch=0-step=100.ckpt')")
    parser.add_argument("dst", help="output file (.safetensors, or anything else for a torch file)")
    parser.add_argument(
        "--strip-prefix",
        default="",
        help="remove this prefix from the keys, e.g. 'model.' so that the example GPT (GPTModule.model) loads "
        "the file with nn.Module.load_state_dict",
    )
    opts = parser.parse_args(args)
    from lightning_npu.parallel.checkpoint import consolidate_model_state

    src, dst = Path(opts.src), Path(opts.dst)
    try:
        tensors, meta = consolidate_model_state(src, strip_prefix=opts.strip_prefix)
    except (FileNotFoundError, RuntimeError) as err:
        parser.error(str(err))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if dst.suffix == ".safetensors":
        from safetensors.torch import save_file

        info = {"source": str(src), "global_step": str(meta.get("global_step", "")),
                "layout": repr(meta.get("lightning_npu", {}))}
        save_file(tensors, str(dst), metadata=info)
    else:
        import torch

        torch.save(tensors, dst)
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()):,} values) to {dst}")


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "convert-checkpoint":
        return convert_checkpoint(args[1:])
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _lightning_cli(args)


if __name__ == "__main__":
    main()
