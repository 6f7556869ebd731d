"""Every argument validated (#34 item 2): each bad input is refused, or warned about, with a message that names the
argument (and its value, and a fix). In-process, no process group; the CLI cases parse and stop before training,
and one console-script run shows that a config with an unknown key does not train."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_npu import NPUHybridStrategy, ParallelConfigError, cli
from lightning_npu.callbacks import (
    DynamicCheckpoint,
    GradientHealthGuard,
    MemoryMonitor,
    PreemptionCheckpoint,
    PrometheusMetrics,
    TrainingGuard,
)
from lightning_npu.planner.cli import main as plan_main
from lightning_npu.validate import check_choice, check_int, check_number, check_writable_dir

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")

# (callback, keyword arguments, the argument the message must name); the value must be named too
CALLBACK_CASES = [
    # the bad inputs of #34: raw TypeErrors or silently accepted before
    (GradientHealthGuard, {"loss_spike_factor": "10"}, "loss_spike_factor"),
    (GradientHealthGuard, {"loss_ema_decay": "0.9"}, "loss_ema_decay"),
    (GradientHealthGuard, {"rollback_lr_factor": "0.5"}, "rollback_lr_factor"),
    (GradientHealthGuard, {"checkpoint_dir": 123}, "checkpoint_dir"),
    (PrometheusMetrics, {"port": 9400, "loss_key": 5}, "loss_key"),
    # GradientHealthGuard, every argument
    (GradientHealthGuard, {"nonfinite_action": "explode"}, "nonfinite_action"),
    (GradientHealthGuard, {"grad_norm_action": 1}, "grad_norm_action"),
    (GradientHealthGuard, {"loss_action": None}, "loss_action"),
    (GradientHealthGuard, {"grad_variance_action": "skipp"}, "grad_variance_action"),
    (GradientHealthGuard, {"loss_spike_action": True}, "loss_spike_action"),
    (GradientHealthGuard, {"update_ratio_action": "skip"}, "update_ratio_action"),
    (GradientHealthGuard, {"grad_norm_range": 5}, "grad_norm_range"),
    (GradientHealthGuard, {"loss_range": ("0", 1)}, "loss_range"),
    (GradientHealthGuard, {"grad_variance_range": (1e-3, 1e-6)}, "grad_variance_range"),
    (GradientHealthGuard, {"loss_spike_factor": 1.0}, "loss_spike_factor"),
    (GradientHealthGuard, {"loss_spike_factor": True}, "loss_spike_factor"),
    (GradientHealthGuard, {"loss_spike_warmup": -1}, "loss_spike_warmup"),
    (GradientHealthGuard, {"loss_spike_warmup": 2.5}, "loss_spike_warmup"),
    (GradientHealthGuard, {"loss_ema_decay": 1.0}, "loss_ema_decay"),
    (GradientHealthGuard, {"update_ratio_target": 0}, "update_ratio_target"),
    (GradientHealthGuard, {"update_ratio_target": "1e-5"}, "update_ratio_target"),
    (GradientHealthGuard, {"update_ratio_tolerance": 1.0}, "update_ratio_tolerance"),
    (GradientHealthGuard, {"update_ratio_every": 0}, "update_ratio_every"),
    (GradientHealthGuard, {"update_ratio_every": True}, "update_ratio_every"),
    (GradientHealthGuard, {"escalate_after": 0}, "escalate_after"),
    (GradientHealthGuard, {"max_rollbacks": "2"}, "max_rollbacks"),
    (GradientHealthGuard, {"rollback_lr_factor": 2.0}, "rollback_lr_factor"),
    (GradientHealthGuard, {"rollback_lr_factor": NAN}, "rollback_lr_factor"),
    (GradientHealthGuard, {"max_warnings": -1}, "max_warnings"),
    # TrainingGuard
    (TrainingGuard, {"max_restarts": -1}, "max_restarts"),
    (TrainingGuard, {"checkpoint_dir": 123}, "checkpoint_dir"),
    (TrainingGuard, {"nonfinite_patience": 0}, "nonfinite_patience"),
    (TrainingGuard, {"health_check_interval": 1.5}, "health_check_interval"),
    (TrainingGuard, {"memory_warn_fraction": 1.5}, "memory_warn_fraction"),
    (TrainingGuard, {"save_initial": 1}, "save_initial"),
    (TrainingGuard, {"allow_fresh_start": "no"}, "allow_fresh_start"),
    (TrainingGuard, {"restart_backoff": -1}, "restart_backoff"),
    (TrainingGuard, {"job_id": 5}, "job_id"),
    (TrainingGuard, {"job_id": ""}, "job_id"),
    # DynamicCheckpoint
    (DynamicCheckpoint, {"dirpath": 123}, "dirpath"),
    (DynamicCheckpoint, {"phase_fractions": "ab"}, "phase_fractions"),
    (DynamicCheckpoint, {"intervals": 5}, "intervals"),
    (DynamicCheckpoint, {"save_on_train_end": "yes"}, "save_on_train_end"),
    (DynamicCheckpoint, {"keep_last_k": 0}, "keep_last_k"),
    (DynamicCheckpoint, {"async_save": 1}, "async_save"),
    (DynamicCheckpoint, {"checksum": None}, "checksum"),
    # PreemptionCheckpoint
    (PreemptionCheckpoint, {"signals": "SIGTERMX"}, "signals"),
    (PreemptionCheckpoint, {"signals": 3.5}, "signals"),
    (PreemptionCheckpoint, {"dirpath": 123}, "dirpath"),
    (PreemptionCheckpoint, {"dirpath": ""}, "dirpath"),
    # PrometheusMetrics (port is required)
    (PrometheusMetrics, {"port": "9400"}, "port"),
    (PrometheusMetrics, {"port": 70000}, "port"),
    (PrometheusMetrics, {"port": 9400, "host": 5}, "host"),
    (PrometheusMetrics, {"port": 9400, "all_ranks": 1}, "all_ranks"),
    (PrometheusMetrics, {"port": 9400, "loss_key": ""}, "loss_key"),
    (PrometheusMetrics, {"port": 9400, "grad_norm_key": None}, "grad_norm_key"),
    (PrometheusMetrics, {"port": 9400, "tokens_per_s_key": 3}, "tokens_per_s_key"),
    (PrometheusMetrics, {"port": 9400, "addr": 5}, "addr"),
    # MemoryMonitor
    (MemoryMonitor, {"activations": 1}, "activations"),
    (MemoryMonitor, {"log_every_n_steps": True}, "log_every_n_steps"),
]


def _id(case) -> str:
    cls, kwargs, name = case
    return f"{cls.__name__}-{name}={kwargs[name]!r}"


@pytest.mark.parametrize("cls, kwargs, name", CALLBACK_CASES, ids=[_id(c) for c in CALLBACK_CASES])
def test_callback_argument_is_refused_naming_it_and_its_value(cls, kwargs, name):
    with pytest.raises((TypeError, ValueError)) as info:
        cls(**kwargs)
    message = str(info.value)
    assert f"{name}=" in message, message
    value = kwargs[name]
    assert repr(value) in message or (isinstance(value, float) and math.isnan(value) and "nan" in message), message
    assert "e.g." in message or "choose one of" in message or "pass (low, high)" in message, message


def test_the_message_of_the_issue():
    with pytest.raises(TypeError) as info:
        GradientHealthGuard(loss_spike_factor="10")
    assert str(info.value) == ("GradientHealthGuard(loss_spike_factor='10'): must be a number > 1, or None, "
                               "e.g. loss_spike_factor=10.0.")


def test_defaults_and_good_values_are_accepted():
    GradientHealthGuard(loss_spike_factor=10, loss_ema_decay=0.9, rollback_lr_factor=1, loss_range=[0, 100],
                        checkpoint_dir=Path("ck"), escalate_after=None, loss_spike_action="stop")
    TrainingGuard(restart_backoff=0, job_id="run-1", memory_warn_fraction=1)
    PrometheusMetrics(9400, addr="127.0.0.1", loss_key="loss")
    MemoryMonitor(log_every_n_steps=10)
    assert PreemptionCheckpoint(signals=signal.SIGUSR1).signals == [signal.SIGUSR1]


# ---- the shared validators ---------------------------------------------------------------------
def test_bool_is_not_a_number_and_a_string_is_not_parsed():
    with pytest.raises(TypeError, match=r"`n=True` must be a positive integer"):
        check_int("n", True)
    with pytest.raises(TypeError, match=r"`x=False` must be a positive number"):
        check_number("x", False, above=0)
    with pytest.raises(TypeError, match=r"`x='0.5'` must be a number in \(0, 1\]"):
        check_number("x", "0.5", above=0, at_most=1)
    with pytest.raises(ParallelConfigError, match=r"`x=inf` must be a positive number"):
        check_number("x", float("inf"), above=0, error=ParallelConfigError)
    with pytest.raises(ValueError, match=r"`stage=True` is unknown; choose one of \[0, 1\]"):
        check_choice("stage", True, (0, 1))
    assert check_number("x", 8, above=0, integral=True) == 8.0
    with pytest.raises(ValueError, match="positive integer"):
        check_number("x", 8.5, above=0, integral=True)


def test_writable_dir_is_created_or_refused_naming_it(tmp_path, monkeypatch):
    assert check_writable_dir("dirpath", tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"C\(dirpath='.*file/sub'\): cannot create this directory"):
        check_writable_dir("dirpath", tmp_path / "file" / "sub", owner="C")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root writes anywhere: pretend it may not
    with pytest.raises(PermissionError, match=r"`dirpath='.*ro'`: this process cannot write in this directory"):
        check_writable_dir("dirpath", tmp_path / "ro")


# ---- checkpoint directories are checked at setup -----------------------------------------------
def _fit(tmp_path, callback):
    trainer = L.Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, accelerator="cpu", devices=1,
                        callbacks=[callback], enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel())
    return trainer


@pytest.mark.parametrize("cls", [DynamicCheckpoint, PreemptionCheckpoint])
def test_unwritable_checkpoint_dir_fails_at_setup(cls, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    under_a_file = tmp_path / "file" / "sub"
    with pytest.raises(NotADirectoryError, match=rf"{cls.__name__}\(dirpath='{under_a_file}'\): cannot create"):
        _fit(tmp_path, cls(dirpath=str(under_a_file)))
    real_access = os.access
    read_only = tmp_path / "read-only"
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != read_only and real_access(p, mode))
    with pytest.raises(PermissionError, match=rf"{cls.__name__}\(dirpath='{read_only}'\): this process cannot write"):
        _fit(tmp_path, cls(dirpath=str(read_only)))


def test_preemption_dir_is_created_at_setup(tmp_path):
    _fit(tmp_path, PreemptionCheckpoint(dirpath=str(tmp_path / "new" / "dir")))
    assert (tmp_path / "new" / "dir").is_dir()


# ---- the strategy: arguments of another layout -------------------------------------------------
@pytest.mark.parametrize("kwargs, arg, size", [
    ({"micro_batches": 8}, "micro_batches=8", "pipeline_parallel_size"),
    ({"pipeline_schedule": "interleaved_1f1b"}, "pipeline_schedule='interleaved_1f1b'", "pipeline_parallel_size"),
    ({"tp_plan": {"*": "colwise"}}, "tp_plan={'*': 'colwise'}", "tensor_parallel_size"),
])
def test_argument_of_another_layout_warns_once_naming_it_and_the_size_it_needs(kwargs, arg, size):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        NPUHybridStrategy(**kwargs)
    ours = [str(w.message) for w in seen if "only applies" in str(w.message)]
    assert ours == [f"`{arg}` only applies with `{size}>1`; at `{size}=1` it is ignored. Set {size} to 2 or more, "
                    f"or drop {arg.split('=')[0]}" + ("; for gradient accumulation use "
                                                       "Trainer(accumulate_grad_batches=8)." if "micro" in arg else ".")]


def test_sequence_parallel_without_tensor_parallel_is_refused():
    with pytest.raises(ParallelConfigError, match=r"`sequence_parallel=True` .* needs `tensor_parallel_size>1`"):
        NPUHybridStrategy(sequence_parallel=True)


def test_defaults_and_arguments_of_the_chosen_layout_are_silent():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        NPUHybridStrategy()
        NPUHybridStrategy(tp_plan="auto")
        NPUHybridStrategy(tp_plan=None)
        NPUHybridStrategy(pipeline_parallel_size=2, micro_batches=4, pipeline_schedule="interleaved_1f1b")
        NPUHybridStrategy(tensor_parallel_size=2, tp_plan={"*": "auto"}, sequence_parallel=True)
    assert [str(w.message) for w in seen if "only applies" in str(w.message)] == []


# ---- the command line --------------------------------------------------------------------------
GOOD = """\
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 1
model:
  class_path: examples.gpt.model.GPTModule
  init_args:
    n_layer: 1
data:
  class_path: examples.gpt.data.TextDataModule
"""


@pytest.mark.parametrize("text, words", [
    (GOOD.replace("  max_steps: 1\n", "  max_stepz: 1\n"), ["line 4: trainer.max_stepz: unknown key"]),
    (GOOD.replace("    n_layer: 1\n", "    n_layerz: 1\n"),
     ["line 8: model.init_args.n_layerz: unknown key", "GPTModule takes no argument 'n_layerz'"]),
    (GOOD + "seed: 3\n", ["line 11: seed: unknown key"]),
    (GOOD.replace("  devices: 1\n", "  devices: 1\n  strategy:\n    class_path: lightning_npu.NPUHybridStrategy\n"
                  "    init_args:\n      zero_stagez: 1\n"), ["line 7: trainer.strategy.init_args.zero_stagez"]),
    (GOOD.replace("  max_steps: 1\n", "  max_steps: 1\n  callbacks:\n    - class_path: lightning_npu.callbacks."
                  "GradientHealthGuard\n      init_args:\n        loss_spike_factor: 0.5\n"),
     ["line 6: trainer.callbacks[0]", "GradientHealthGuard(loss_spike_factor=0.5): must be a number > 1"]),
    ("trainer:\n  devices: [1\n  x: : :\n", ["line 3, column 4: not valid YAML"]),
    ("", ["is empty", "examples/gpt/config.yaml"]),
    ("- trainer\n- model\n", ["line 1: the top level is a list, not a mapping"]),
])
def test_config_errors_are_one_line_naming_file_line_and_key(text, words, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"lightning-npu fit: error: {config}"), err
    for w in words:
        assert w in err[0], err


def test_a_bad_value_set_on_the_command_line_is_named_as_the_option(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(config), "--trainer.max_steps", "many"])
    assert capsys.readouterr().err.strip() == (
        "lightning-npu fit: error: --trainer.max_steps: Expected a <class 'int'>. Got value: many")


def test_a_value_a_constructor_refuses_ends_in_our_message_naming_the_option(capsys, monkeypatch):
    # the issue's command: the project's message is the last (and only) line, and it names the option that gave it
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--config", "examples/gpt/config.yaml", "--trainer.strategy.init_args.zero_stage", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert err[-1] == (
        "lightning-npu fit: error: examples/gpt/config.yaml, line 13: trainer.strategy (with "
        "--trainer.strategy.init_args.zero_stage from the command line): `zero_stage=5` is not a ZeRO stage; use 0 "
        "(replicate), 1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters).")


def test_plan_without_arguments_lists_everything_missing_and_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_main([])
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines  # one line, no argparse usage before it
    err = lines[0]
    assert err.startswith("lightning-npu plan: error: give "), err
    for words in ("--model CONFIG.yaml", "--layers --hidden --heads --vocab --seq --global-batch", "--devices N",
                  "For example: lightning-npu plan --model examples/llama/config.yaml --devices 8"):
        assert words in err, err


def test_unknown_key_does_not_train_from_the_console_script(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(GOOD.replace("  max_steps: 1\n", "  max_steps: 1\n  max_epochz: 1\n"))
    script = Path(sys.executable).with_name("lightning-npu")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_npu.cli"]
    proc = subprocess.run(cmd + ["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"lightning-npu fit: error: {config}, line 5: trainer.max_epochz: unknown key; "
                                   "`lightning-npu fit --help` lists the accepted keys."), proc.stderr
    assert "usage:" not in proc.stderr and "Trainer.fit" not in proc.stdout + proc.stderr
