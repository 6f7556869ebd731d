"""A resume in the middle of an epoch continues the data where the checkpoint stopped (no replay), in every layout,
with gradient accumulation, and under another dp size (the global sample order is kept)."""

import io

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_npu.launch import spawn
from lightning_npu.parallel.data_parallel.sampler import ResumableDataLoader, resumable_dataloader
from lightning_npu.parallel.mesh import dp_rank_of
from tests._sampler_workers import STEP4, run_many

RTOL, ATOL = 1e-5, 1e-6
STEPS = 8
# the same global batch (4 samples per optimizer step) in every layout; a few thousand steps per epoch
LAYOUTS = {
    "dp2": dict(batch_size=2),
    "tp2": dict(batch_size=4, strategy_kwargs=dict(tensor_parallel_size=2)),
    "pp2": dict(batch_size=4, strategy_kwargs=dict(pipeline_parallel_size=2)),
    "dp2_acc2": dict(batch_size=1, accumulate_grad_batches=2),
}
EPOCH_END = dict(batch_size=2, limit_train_batches=3)
# the dp=2 checkpoint resumed by one process: the doubled batch, or the same batch accumulated twice
DP1 = {"dp1_batch4": dict(batch_size=4), "dp1_acc2": dict(batch_size=2, accumulate_grad_batches=2)}


def _loader(dataset, dp, rank, batch_size, shuffle=True, drop_last=False, epoch=0, **kwargs):
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
    sampler.set_epoch(epoch)
    loader = resumable_dataloader(DataLoader(dataset, batch_size=batch_size, sampler=sampler, **kwargs))
    assert isinstance(loader, ResumableDataLoader)
    return loader, sampler


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (True, True), (False, False)])
def test_order_is_distributed_samplers(dp, shuffle, drop_last):
    """An uninterrupted run reads exactly what Lightning's DistributedSampler gives each rank (seed + epoch)."""
    for rank in range(dp):
        loader, reference = _loader(list(range(37)), dp, rank, 4, shuffle, drop_last, epoch=3)
        assert list(loader.sampler) == list(reference)
        assert len(loader) == len(DataLoader(list(range(37)), batch_size=4, sampler=reference))


def _consume(loaders, batches):
    iterators = [iter(loader) for loader in loaders]
    return [torch.cat([next(it) for it in iterators]) for _ in range(batches)]  # global batches, rank-major


def test_state_resumes_at_consumed_samples_under_another_dp():
    data = list(range(101))
    full = _consume([_loader(data, 2, r, 3)[0] for r in range(2)], 10)
    loaders = [_loader(data, 2, r, 3)[0] for r in range(2)]
    _consume(loaders, 4)
    state = loaders[0].state_dict()
    assert state == loaders[1].state_dict()
    assert state["consumed_samples"] == 4 * 3 * 2 and state["epoch"] == 0 and state["global_batch_size"] == 6
    # plain ints and bools: the checkpoint's metadata file loads with weights_only=True
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state
    # dp 2 -> 2 and dp 2 -> 1 (doubled batch): the same global batches, in the same order
    for dp, batch in ((2, 3), (1, 6)):
        resumed = [_loader(data, dp, r, batch)[0] for r in range(dp)]
        for loader in resumed:
            loader.load_state_dict(state)
            assert loader.state_dict()["consumed_samples"] == 24  # before the first batch too
            assert len(loader) == len(loaders[0])  # the whole epoch in the same global batches, as Lightning counts
        for got, want in zip(_consume(resumed, 6), full[4:]):
            assert sorted(got.tolist()) == sorted(want.tolist())
        assert resumed[0].state_dict()["consumed_samples"] == 60
    # the next epoch starts at its beginning, with its own permutation
    loader, reference = _loader(data, 2, 0, 3)
    loader.load_state_dict(state)
    loader.sampler.set_epoch(1)
    reference.set_epoch(1)
    assert torch.cat(list(loader)).tolist() == list(reference)


def test_workers_prefetch_is_not_counted():
    """Worker processes take indices ahead of training: the state counts the batches handed out."""
    data = list(range(64))
    loader, _ = _loader(data, 2, 0, 2, num_workers=2, prefetch_factor=4)
    iterator = iter(loader)
    first = [next(iterator) for _ in range(3)]
    assert loader.state_dict()["consumed_samples"] == 3 * 2 * 2
    resumed, _ = _loader(data, 2, 0, 2)
    resumed.load_state_dict(loader.state_dict())
    fresh, _ = _loader(data, 2, 0, 2)
    assert torch.cat(first + list(resumed)).tolist() == torch.cat(list(fresh)).tolist()


def test_finished_epoch_and_foreign_state():
    loader, _ = _loader(list(range(16)), 2, 0, 2)
    loader.load_state_dict({"epoch": 0, "consumed_samples": 16})
    assert list(loader) == []  # saved after the epoch's last batch: the rest of the epoch is empty, not a replay
    assert len(list(loader)) == 4  # and the next pass starts at the beginning
    with pytest.raises(ValueError, match="consumed_samples"):
        loader.load_state_dict({"_snapshot": {}})  # another loader's state (e.g. torchdata's StatefulDataLoader)


def test_only_plain_map_style_loaders_are_converted():
    data = list(range(16))
    sampler = DistributedSampler(data, num_replicas=2, rank=0)

    class MyLoader(DataLoader):
        pass

    for loader in (
        MyLoader(data, batch_size=2, sampler=sampler),  # a subclass keeps its class and behaviour
        DataLoader(data, batch_size=2),  # no DistributedSampler (use_distributed_sampler=False)
        DataLoader(data, batch_sampler=[[0, 1], [2, 3]]),  # a custom batch sampler
    ):
        assert resumable_dataloader(loader) is loader


@pytest.mark.parametrize("shape", [(1, 4, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2), (1, 2, 2, 2), (2, 1, 2, 2)])
def test_dp_rank_before_the_mesh_is_the_meshs(shape):
    """`init_device_mesh` lays the ranks out row-major over (pp, dp[, cp], tp): the dp coordinate the strategy gives
    Lightning's data connector before the processes start is the one the mesh gives after."""
    world = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    for rank in range(world.numel()):
        assert dp_rank_of(shape, rank) == int((world == rank).nonzero()[0][1]), (shape, rank)


def test_distributed_sampler_kwargs_outside_fit():
    """Lightning's data connector asks for the sampler's split outside `fit` (its own tests, a user's
    `trainer._data_connector`): answered from the layout as DDPStrategy answers from its devices, not refused."""
    import lightning as L

    from lightning_npu import NPUHybridStrategy

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=NPUHybridStrategy(tensor_parallel_size=2),
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    strategy = trainer.strategy
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    strategy.cluster_environment.set_global_rank(3)  # tp peers 2, 3 are dp rank 1
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


# ---- real processes: uninterrupted 8 steps vs 4 steps, a step-4 checkpoint (DCP directory), a fresh resume to 8 ----
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    names = list(LAYOUTS)
    # the uninterrupted runs also save the mid-epoch step-4 checkpoints
    full = [dict(**LAYOUTS[n], steps=STEPS, ckpt_dir=str(root / n)) for n in names]
    resumed = [dict(**LAYOUTS[n], steps=STEPS, ckpt_in=str(root / n / STEP4)) for n in names]
    # and a checkpoint at the last batch of a 3-batch epoch: the resume goes on with the next epoch
    full.append(dict(**EPOCH_END, steps=6, every=3, ckpt_dir=str(root / "epoch_end")))
    resumed.append(dict(**EPOCH_END, steps=6, ckpt_in=str(root / "epoch_end" / "epoch=0-step=3.ckpt")))
    full, resumed = spawn(run_many, 2, full), spawn(run_many, 2, resumed)
    out = {n: {"full": [r[i] for r in full], "resumed": [r[i] for r in resumed]} for i, n in enumerate(names)}
    out["epoch_end"] = {"full": [r[-1] for r in full], "resumed": [r[-1] for r in resumed]}
    return {"root": root, **out}


@pytest.fixture(scope="module")
def dp1_runs(runs):
    configs = [dict(**c, steps=STEPS, ckpt_in=str(runs["root"] / "dp2" / STEP4)) for c in DP1.values()]
    return dict(zip(DP1, spawn(run_many, 1, configs)[0]))


def _step_losses(run, accumulate=1):
    """The dp-mean loss of each optimizer step (the mean of its equal-size micro-batches' losses)."""
    losses = torch.tensor(run["losses"], dtype=torch.float64)
    return losses.view(-1, accumulate).mean(1)


def _global_batches(ranks, accumulate=1):
    """The samples of each optimizer step, all dp ranks and micro-batches together, in a canonical order."""
    per_batch = [sum((rank["samples"][b] for rank in ranks), []) for b in range(len(ranks[0]["samples"]))]
    return [sorted(sum(per_batch[s : s + accumulate], [])) for s in range(0, len(per_batch), accumulate)]


def _check_same_params(got, want):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    return max(float((got[k] - want[k]).abs().max()) for k in want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mid_epoch_resume_equals_uninterrupted(runs, layout):
    accumulate = LAYOUTS[layout].get("accumulate_grad_batches", 1)
    for rank, (full, resumed) in enumerate(zip(runs[layout]["full"], runs[layout]["resumed"])):
        assert resumed["global_step"] == STEPS
        assert full["num_training_batches"] > 1000  # the checkpoint at step 4 is in the middle of the epoch
        want = _step_losses(full, accumulate)[4:]
        got = _step_losses(resumed, accumulate)
        print(f"{layout} rank {rank}: max |loss diff| {float((got - want).abs().max()):.3g}", end=", ")
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
        print(f"max |param diff| {_check_same_params(resumed['state'], full['state']):.3g}")
        # the resumed run reads the uninterrupted run's batches 5..8, not the epoch's first ones again
        assert resumed["samples"] == full["samples"][4 * accumulate :], f"rank {rank}"
        assert full["loader"] == resumed["loader"] == "ResumableDataLoader"
        assert resumed["loader_state"] == full["loader_state"]
        assert full["loader_state"]["consumed_samples"] == STEPS * 4
    ranks = runs[layout]["full"]
    if LAYOUTS[layout].get("strategy_kwargs"):  # tp / pp peers (dp=1) read the same batches
        assert ranks[0]["samples"] == ranks[1]["samples"]
    else:  # dp ranks read disjoint samples
        assert not {str(s) for b in ranks[0]["samples"] for s in b} & {str(s) for b in ranks[1]["samples"] for s in b}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(DP1))
def test_resume_under_another_dp_size_keeps_the_global_order(runs, dp1_runs, layout):
    """dp=2 (batch 2) checkpoint at step 4 resumed by one process with batch 4, or batch 2 accumulated twice."""
    accumulate = DP1[layout].get("accumulate_grad_batches", 1)
    full, resumed = runs["dp2"]["full"], dp1_runs[layout]
    assert resumed["global_step"] == STEPS
    want = _step_losses(full[0])[4:]
    got = _step_losses(resumed, accumulate)
    print(f"{layout}: max |loss diff| {float((got - want).abs().max()):.3g}", end=", ")
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    print(f"max |param diff| {_check_same_params(resumed['state'], full[0]['state']):.3g}")
    assert _global_batches([resumed], accumulate) == _global_batches(full)[4:]
    assert resumed["loader"] == "ResumableDataLoader"
    assert resumed["loader_state"]["consumed_samples"] == STEPS * 4


def test_resume_at_an_epoch_end_starts_the_next_epoch(runs):
    """A checkpoint after an epoch's last batch (limit_train_batches=3, step 3): the resume reads epoch 1 from its
    start, as the uninterrupted run does (the saved position belongs to the finished epoch)."""
    for full, resumed in zip(runs["epoch_end"]["full"], runs["epoch_end"]["resumed"]):
        torch.testing.assert_close(_step_losses(resumed), _step_losses(full)[3:], rtol=RTOL, atol=0)
        _check_same_params(resumed["state"], full["state"])
        assert resumed["samples"] == full["samples"][3:]
        assert resumed["loader_state"]["epoch"] == 1 and resumed["loader_state"]["consumed_samples"] == 3 * 4
