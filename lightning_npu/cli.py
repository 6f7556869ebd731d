"""`lightning-npu` command line, built on LightningCLI.

``fit|validate|test|predict`` are LightningCLI's own subcommands with the ``npu_hybrid``
strategy registered; ``convert-checkpoint``, ``plan``, ``doctor`` and ``build-ops`` are ours (listed in
``--help`` with them). The current
directory is importable (as with ``python -m``) so that a config's ``class_path`` can name modules
of the user's project, e.g. ``examples.gpt.model.GPTModule``.

``fit --ckpt_path latest`` resumes from the newest complete checkpoint that the configured
DynamicCheckpoint or ModelCheckpoint callbacks wrote, or starts fresh and says so.
"""

from __future__ import annotations

import os
import shlex
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Callable, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lightning_npu  # noqa: F401  (registers "npu" and "npu_hybrid")
from lightning_npu.callbacks import DynamicCheckpoint
from lightning_npu.callbacks._store import CheckpointCorruptedError, list_complete, verify_marked
from lightning_npu.config_file import ConfigFileError, config_paths, explain, read_config
from lightning_npu.doctor import command as doctor_command
from lightning_npu.extras import import_optional
from lightning_npu.parallel.checkpoint.hf_export import NotATransformersCheckpointError, export_hf
from lightning_npu.ops import extension
from lightning_npu.parallel.checkpoint.formats import load_checkpoint
from lightning_npu.planner.cli import command as plan_command

PROG = "lightning-npu"
LATEST = "latest"
CKPT_PATH_HELP = (
    f'"{LATEST}" (lightning-npu): the newest complete checkpoint that the configured DynamicCheckpoint or '
    "ModelCheckpoint callbacks wrote, or a fresh start when there is none, so that one command starts and "
    'continues a run. "last" (Lightning): the newest of DynamicCheckpoint\'s checkpoints and ModelCheckpoint\'s '
    "last.ckpt. Lightning's text: "
)


def convert_checkpoint(args: list[str]) -> None:
    """`lightning-npu convert-checkpoint SRC DST [--to state_dict|lightning|hf]`: any checkpoint (a sharded
    directory saved under any layout, or a single file) -> full tensors in a form other tools load."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"{PROG} convert-checkpoint",
        description="Convert a lightning-npu checkpoint (a sharded directory saved under any tp/pp/dp/zero layout, "
        "or a single .ckpt file) into full tensors: --to state_dict (default) writes the model's tensors to one "
        "file (safetensors if DST ends in .safetensors, else a torch file: a plain dict of tensors, loadable with "
        "torch.load(..., weights_only=True)); --to lightning writes one Lightning .ckpt file "
        "(LightningModule.load_from_checkpoint, Trainer(strategy='ddp').fit(ckpt_path=...)); --to hf writes a "
        "transformers save_pretrained folder (from_pretrained) when the LightningModule holds a "
        "transformers.PreTrainedModel.",
    )
    parser.add_argument("src", help="checkpoint directory or file (e.g. ModelCheckpoint's 'epoch=0-step=100.ckpt')")
    parser.add_argument("dst", help="output file (--to state_dict, lightning) or folder (--to hf)")
    parser.add_argument("--to", choices=("state_dict", "lightning", "hf"), default="state_dict",
                        help="output form (default: state_dict)")
    parser.add_argument(
        "--strip-prefix",
        default="",
        help="(--to state_dict) remove this prefix from the keys, e.g. 'model.' so that the example GPT "
        "(GPTModule.model) loads the file with nn.Module.load_state_dict",
    )
    opts = parser.parse_args(args)
    src, dst = Path(opts.src), Path(opts.dst)
    try:
        if opts.to == "hf":
            export_hf(src, dst)
            print(f"wrote a transformers save_pretrained folder to {dst}")
            return
        checkpoint = load_checkpoint(src)  # verified against its marker first, where it has one
    except (OSError, RuntimeError, ValueError, EOFError, NotATransformersCheckpointError) as err:
        _fail(f"{PROG} convert-checkpoint", err)
    import torch

    dst.parent.mkdir(parents=True, exist_ok=True)
    if opts.to == "lightning":
        torch.save(checkpoint, dst)
        print(f"wrote a Lightning checkpoint file to {dst}")
        return
    tensors = {k[len(opts.strip_prefix):] if opts.strip_prefix and k.startswith(opts.strip_prefix) else k:
               v.contiguous() for k, v in checkpoint["state_dict"].items()}
    if dst.suffix == ".safetensors":
        save_file = import_optional("safetensors.torch", "convert-checkpoint to a .safetensors file").save_file
        info = {"source": str(src), "global_step": str(checkpoint.get("global_step", "")),
                "layout": repr({k: v for k, v in (checkpoint.get("lightning_npu") or {}).items() if k != "hf"})}
        save_file(tensors, str(dst), metadata=info)
    else:
        torch.save(tensors, dst)
    print(f"wrote {len(tensors)} tensors ({sum(t.numel() for t in tensors.values()):,} values) to {dst}")


def build_ops(args: list[str]) -> None:
    """`lightning-npu build-ops`: build the fused C++ kernels into the cache now, so that no training job compiles."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=f"{PROG} build-ops",
        description="Build the fused C++ CPU kernels (fuse_ops=True) for this torch, CPU and install into the cache "
        f"({extension.cache_dir()}; TORCH_EXTENSIONS_DIR moves it) now, so that no training job compiles them. A build "
        "that is already there is only loaded; one running in another process is waited for; a stale lock left by "
        "a killed build is removed. LIGHTNING_NPU_VERBOSE_BUILD=1 shows the compiler's output.",
    )
    parser.parse_args(args)
    try:
        library = extension.build()
    except Exception as err:  # no compiler, no csrc/, a compile error, an unsafe cache directory
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        parser.exit(1, f"{PROG} build-ops: the fused C++ kernels could not be built: {first}\n")
    print(f"fused C++ kernels ready: {library}")


def version_line() -> str:
    import lightning
    import torch

    return f"{PROG} {lightning_npu.__version__} (lightning {lightning.__version__}, torch {torch.__version__})"


def _fail(prog: str, err: BaseException) -> None:
    """One line on stderr naming what failed, exit status 2 (as argparse's errors): a bad or unreadable
    checkpoint is the user's input, not a bug to show a traceback for."""
    message = " ".join(str(err).split()) or type(err).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# Commands that are not LightningCLI's: name -> (function of the remaining args, one-line help).
# They run before LightningCLI parses anything, and are listed in `lightning-npu --help`.
COMMANDS: dict[str, tuple[Callable[[list[str]], Any], str]] = {
    "convert-checkpoint": (
        convert_checkpoint,
        "Convert a checkpoint (sharded directory or file) to full tensors: a state-dict file, a Lightning .ckpt "
        "file or a transformers folder (SRC DST [--to state_dict|lightning|hf]; see its --help).",
    ),
    "plan": (plan_command, "Rank parallel layouts of a model on a cluster by estimated memory and tokens/s (see --help)."),
    "doctor": (doctor_command, "Check that this machine is ready to train: versions, devices, backends, HCCL, the "
               "fused kernels' build (--json; compiles nothing unless --build)."),
    "build-ops": (build_ops, "Build the fused C++ CPU kernels into the cache now, so that no training job compiles "
                  "them (see --help)."),
}

# `--trainer.strategy.help npu_hybrid`: jsonargparse wants a class path; registered names map to their class.
_HELP_FLAGS = ("--trainer.strategy.help", "--trainer.accelerator.help")


def _class_path(flag: str, name: str) -> str:
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    registry = StrategyRegistry if "strategy" in flag else AcceleratorRegistry
    if name in registry:
        cls = registry[name]["strategy" if "strategy" in flag else "accelerator"]
        return f"{cls.__module__}.{cls.__qualname__}"
    return name


def _alias_registered_names(args: list[str]) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out):
        for flag in _HELP_FLAGS:
            if arg == flag and i + 1 < len(out):
                out[i + 1] = _class_path(flag, out[i + 1])
            elif arg.startswith(flag + "="):
                out[i] = f"{flag}={_class_path(flag, arg[len(flag) + 1:])}"
    return out


def _without_ckpt_path(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            out.append(arg)
    return out


# ---- checkpoint discovery for `--ckpt_path latest` --------------------------------------------
def _dynamic_dir(trainer: Any, callback: Any) -> Path:
    # DynamicCheckpoint resolves its default at setup; this is the same default
    return Path(callback.dirpath) if callback.dirpath is not None else Path(trainer.default_root_dir) / "checkpoints"


def _model_checkpoint_dirs(trainer: Any, callback: Any) -> list[Path]:
    """Where ModelCheckpoint writes: its dirpath, else (as Lightning resolves it) the first logger's
    ``save_dir/name/<version>/checkpoints`` of every earlier version, else ``default_root_dir/checkpoints``."""
    if callback.dirpath is not None:
        return [Path(callback.dirpath)]
    if trainer.loggers:
        logger = trainer.loggers[0]
        base = Path(logger.save_dir or trainer.default_root_dir)
        name = logger.name
        if isinstance(name, str) and name:
            base = base / name
        return sorted(base.glob("*/checkpoints"))
    return [Path(trainer.default_root_dir) / "checkpoints"]


def find_latest_checkpoint(trainer: Any) -> tuple[Optional[str], list[Path]]:
    """The newest complete checkpoint written by the trainer's DynamicCheckpoint / ModelCheckpoint
    callbacks (by modification time, as Lightning's ``ckpt_path="last"``), and the folders searched.

    DynamicCheckpoint's own discovery decides what is complete (marker, verification). A ModelCheckpoint
    path is complete once it exists under its final name: npu_hybrid commits by renaming, and names that
    start with "." are writes in progress or copies set aside.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    candidates: dict[str, float] = {}
    searched: list[Path] = []
    dynamic_dirs = set()
    for cb in trainer.callbacks:
        if isinstance(cb, DynamicCheckpoint):
            dirpath = _dynamic_dir(trainer, cb)
            searched.append(dirpath)
            dynamic_dirs.add(dirpath.resolve())
            found = DynamicCheckpoint.find_latest(dirpath)
            if found is not None:
                candidates[found] = Path(found).stat().st_mtime
    verified = set(candidates)
    for cb in trainer.callbacks:
        if not isinstance(cb, ModelCheckpoint) or isinstance(cb, DynamicCheckpoint):
            continue
        for dirpath in _model_checkpoint_dirs(trainer, cb):
            searched.append(dirpath)
            if not dirpath.is_dir():
                continue
            # a folder shared with DynamicCheckpoint: its checkpoints were judged above
            theirs = {i.path.name for i in list_complete(dirpath)} if dirpath.resolve() in dynamic_dirs else set()
            for path in dirpath.iterdir():
                if path.name.startswith(".") or path.suffix != cb.FILE_EXTENSION or path.name in theirs:
                    continue
                if path.is_dir() and not (path / "meta.pt").is_file():
                    continue  # not a sharded checkpoint
                candidates[str(path)] = path.stat().st_mtime
    # newest first; one with a marker (npu_hybrid writes one for every checkpoint) must match it
    for path in sorted(candidates, key=candidates.get, reverse=True):
        if path in verified:
            return path, list(dict.fromkeys(searched))
        try:
            verify_marked(path)
            return path, list(dict.fromkeys(searched))
        except CheckpointCorruptedError as err:
            rank_zero_warn(f"{err} Falling back to an earlier checkpoint.")
    return None, list(dict.fromkeys(searched))


class NPUCLI(LightningCLI):
    """LightningCLI with ``--ckpt_path latest``, registered-name help and a resume hint after fit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._argv: list[str] = []
        super().__init__(*args, **kwargs)

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.add_argument("--version", action="version", version=version_line(),
                                 help="Print the versions of lightning-npu, Lightning and torch, and exit.")
        if add_subcommands:
            # listed in --help only: main() runs these before LightningCLI parses
            action = self.parser._subcommands_action
            for name, (_, help_text) in COMMANDS.items():
                action.add_subcommand(name, LightningArgumentParser(prog=f"{PROG} {name}", description=help_text),
                                      help=help_text)
            for ckpt_action in action._name_parser_map["fit"]._actions:
                if ckpt_action.dest == "ckpt_path":
                    ckpt_action.help = CKPT_PATH_HELP + (ckpt_action.help or "")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # `args=None` reads sys.argv (the console script); a list replaces it (main([...]) from Python). Either
        # way the arguments come from one place, so Lightning's "both args and command line" warning has no case.
        args = list(sys.argv[1:] if args is None else args)
        self._argv = args
        paths = config_paths(args)
        try:
            for path in paths:  # bad YAML, an empty file, a list: named before jsonargparse tries them
                read_config(path)
            self.config = parser.parse_args(_alias_registered_names(args))
        except ConfigFileError as err:
            self._refuse(str(err))
        except ArgumentError as err:  # the parsers are built with exit_on_error=False (see `_lightning_cli`)
            self._refuse(explain(str(err), paths, self._command(), args))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:
            # a constructor that refused its arguments reaches here inside jsonargparse's union-type report
            if not _raised_in_jsonargparse(err):
                raise
            self._refuse(explain(str(err), config_paths(self._argv), self._command(), self._argv))

    def _command(self) -> str:
        sub = next((a for a in self._argv if a in self.subcommands()), None)
        return f"{PROG} {sub}" if sub else PROG

    def _refuse(self, line: str) -> None:
        """One line on stderr, exit status 2 (as argparse's errors), instead of the usage text and a dump."""
        print(f"{self._command()}: error: {line}", file=sys.stderr, flush=True)
        sys.exit(2)

    def before_fit(self) -> None:
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") != LATEST:
            return
        path, searched = find_latest_checkpoint(self.trainer)
        config["ckpt_path"] = path
        if self.trainer.is_global_zero:
            where = ", ".join(str(p) for p in searched) or "nowhere: no DynamicCheckpoint or ModelCheckpoint is configured"
            if path is None:
                print(f"{PROG}: --ckpt_path latest: no complete checkpoint in {where}; starting fresh.", flush=True)
            else:
                print(f"{PROG}: --ckpt_path latest: resuming from {path}", flush=True)

    def after_fit(self) -> None:
        if not self.trainer.is_global_zero or self.trainer.interrupted:
            return
        from lightning.pytorch.callbacks import ModelCheckpoint

        lines = []
        for cb in self.trainer.callbacks:
            if isinstance(cb, DynamicCheckpoint) and cb.dirpath is not None:
                last = cb.latest()
                lines.append(f"  DynamicCheckpoint: {cb.dirpath}" + (f" (newest: {Path(last).name})" if last else ""))
            elif isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
                last = cb.last_model_path or cb.best_model_path
                lines.append(f"  ModelCheckpoint: {cb.dirpath}" + (f" (newest: {Path(last).name})" if last else ""))
        if not lines:
            return
        resume = shlex.join([PROG, *_without_ckpt_path(self._argv), "--ckpt_path", LATEST])
        print("\n".join([f"{PROG}: checkpoints are in", *lines, "Resume this run with:", f"  {resume}"]), flush=True)


def _raised_in_jsonargparse(err: BaseException) -> bool:
    """Whether jsonargparse raised `err` itself (its report of a failed instantiation), not user code it ran."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}jsonargparse{os.sep}" in tb.tb_frame.f_code.co_filename


def _lightning_cli(args: Optional[list[str]]) -> None:
    from lightning.pytorch import LightningDataModule, LightningModule

    NPUCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        # errors come back as exceptions, which NPUCLI says in one line naming the file, line and key
        parser_kwargs={"prog": PROG, "exit_on_error": False,
                       "description": "Train, evaluate and manage checkpoints with lightning-npu "
                       "(LightningCLI with the npu_hybrid strategy registered)."},
    )


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of `lightning-npu`; `argv` replaces the command line (``sys.argv[1:]``) when given."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]][0](args[1:])
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _lightning_cli(argv)


if __name__ == "__main__":
    main()
