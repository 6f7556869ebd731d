"""`benchmarks/scaling.py --profile`: each step's split from torch.profiler's events (`split_steps`) on a synthetic
trace, and on a real profiled step of one process."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks.scaling import split_steps


def _event(name: str, start: float, end: float, thread: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def test_split_steps_classifies_the_main_thread_time():
    events = [
        _event("ProfilerStep#1", 0, 100),
        _event("aten::mm", 0, 30),                       # forward/backward
        _event("c10d::allreduce_", 30, 35),              # launching a bucket's reduction
        _event("gloo:all_reduce", 30, 60, thread=2),     # running on gloo's thread: overlapped until 40
        _event("aten::mm", 35, 40),
        _event("split:optimizer", 70, 95),               # on_before_optimizer_step .. the step's end
        _event("aten::_foreach_add_", 72, 90),
        _event("gloo:all_gather", 90, 100, thread=2),    # in flight after the step's end: waited (exposed)
    ]
    (split,) = split_steps(events)
    # in ms (events are in us): 0-30 and 35-40 compute, 30-35 a c10d call, 40-60 and 95-100 waiting on gloo
    assert split == pytest.approx({"compute": 0.035, "exposed_comm": 0.030, "optimizer": 0.025, "other": 0.010,
                                   "step": 0.100})


def test_split_steps_counts_dtensor_functional_collectives_as_communication():
    events = [
        _event("ProfilerStep#1", 0, 100),
        _event("aten::mm", 0, 40),
        _event("_c10d_functional::all_reduce", 40, 45),  # DTensor's tp all-reduce, launched
        _event("_c10d_functional::wait_tensor", 45, 70),  # ... and waited for
        _event("aten::mm", 70, 100),
    ]
    (split,) = split_steps(events)
    assert split == pytest.approx({"compute": 0.070, "exposed_comm": 0.030, "optimizer": 0.0, "other": 0.0,
                                   "step": 0.100})


def test_split_steps_of_a_profiled_step():
    from torch.profiler import ProfilerActivity, profile, schedule

    lin = torch.nn.Linear(32, 32)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 acc_events=True) as prof:
        for _ in range(3):
            lin(torch.randn(8, 32)).sum().backward()
            with torch.autograd.profiler.record_function("split:optimizer"):
                with torch.no_grad():
                    lin.weight.sub_(lin.weight.grad)
            prof.step()
    splits = split_steps(prof.events())
    assert len(splits) == 2
    for s in splits:
        assert s["compute"] > 0 and s["optimizer"] > 0 and s["exposed_comm"] == 0
        assert abs(sum(s[k] for k in ("compute", "exposed_comm", "optimizer", "other")) - s["step"]) < 1e-6
