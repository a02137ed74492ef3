import itertools
import pickle

import numpy as np
import pytest
import torch

from data.datasets import PretrainDataset, ResumableBatchSampler, split_train_valid
from data.indexed import IndexedDataset, IndexedDatasetBuilder


@pytest.fixture
def indexed(tmp_path) -> IndexedDataset:
    rng = np.random.default_rng(1)
    with IndexedDatasetBuilder(tmp_path / "d", np.uint16) as builder:
        for _ in range(40):
            builder.add_document(rng.integers(0, 50_000, int(rng.integers(1, 200))))
    return IndexedDataset(tmp_path / "d")


def test_pretrain_packing_matches_token_stream(indexed):
    stream = np.concatenate([indexed[i] for i in range(len(indexed))]).astype(np.int64)
    seq_len = 64
    ds = PretrainDataset(indexed, seq_len)
    assert len(ds) == (len(stream) - 1) // seq_len
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.dtype == torch.int64 and sample.shape == (seq_len + 1,)
        assert np.array_equal(sample.numpy(), stream[i * seq_len:i * seq_len + seq_len + 1])
    # inputs/targets: every token after the first is a target exactly once
    targets = torch.cat([ds[i][1:] for i in range(len(ds))])
    assert np.array_equal(targets.numpy(), stream[1:len(ds) * seq_len + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="too few for one sample"):
        PretrainDataset(indexed, len(stream))


def test_split_train_valid_is_disjoint_and_fixed():
    train, valid = split_train_valid(1000, 0.05, seed=3)
    assert len(valid) == 50 and len(train) == 950
    assert set(train).isdisjoint(valid) and set(train) | set(valid) == set(range(1000))
    again = split_train_valid(1000, 0.05, seed=3)
    assert np.array_equal(again[1], valid) and np.array_equal(again[0], train)
    assert not np.array_equal(split_train_valid(1000, 0.05, seed=4)[1], valid)
    assert len(split_train_valid(10, 0.01, seed=0)[1]) == 1
    assert len(split_train_valid(10, 0.0, seed=0)[1]) == 0


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_sampler_determinism_and_seed():
    indices = np.arange(100, 200)
    a = take(ResumableBatchSampler(indices, 4, 0, 1, seed=7), 25)
    b = take(ResumableBatchSampler(indices, 4, 0, 1, seed=7), 25)
    c = take(ResumableBatchSampler(indices, 4, 0, 1, seed=8), 25)
    assert a == b and a != c
    assert sorted(sum(a, [])) == list(range(100, 200))  # one epoch is a permutation of the indices
    unshuffled = take(ResumableBatchSampler(indices, 4, 0, 1, seed=7, shuffle=False), 2)
    assert unshuffled == [[100, 101, 102, 103], [104, 105, 106, 107]]


def test_union_of_ranks_equals_single_process():
    indices = np.arange(103)  # 3 left over per epoch for a global micro-batch of 4
    steps = 60  # crosses two epoch boundaries
    single = take(ResumableBatchSampler(indices, 4, 0, 1, seed=5), steps)
    for world, mbs in [(2, 2), (4, 1)]:
        per_rank = [take(ResumableBatchSampler(indices, mbs, r, world, seed=5), steps) for r in range(world)]
        union = [sum((per_rank[r][step] for r in range(world)), []) for step in range(steps)]
        assert union == single


def test_resume_from_consumed_samples_and_epoch_wrap():
    indices = np.arange(50)
    sampler = ResumableBatchSampler(indices, 3, 1, 2, seed=11)  # global micro-batch 6: 8 per epoch, 2 dropped
    assert sampler.samples_per_epoch == 48
    full = take(sampler, 30)
    assert sampler.consumed_samples == 180 and sampler.epoch == 3
    for k in (0, 1, 7, 8, 9, 17):
        resumed = ResumableBatchSampler(indices, 3, 1, 2, seed=11, consumed_samples=k * 6)
        assert take(resumed, 30 - k) == full[k:]
    epoch0, epoch1 = sum(full[:8], []), sum(full[8:16], [])
    assert epoch0 != epoch1 and len(set(epoch0)) == len(epoch0) == 24
    state = sampler.state_dict()
    restored = ResumableBatchSampler(indices, 3, 1, 2, seed=0)
    restored.load_state_dict(state)
    assert take(restored, 3) == take(ResumableBatchSampler(indices, 3, 1, 2, seed=11, consumed_samples=180), 3)


def test_resume_on_another_world_size():
    indices = np.arange(64)
    single = take(ResumableBatchSampler(indices, 8, 0, 1, seed=2), 8)
    before = [take(ResumableBatchSampler(indices, 2, r, 4, seed=2), 5) for r in range(4)]  # 40 samples
    assert [sum(step, []) for step in zip(*before)] == single[:5]
    after = [take(ResumableBatchSampler(indices, 4, r, 2, seed=2, consumed_samples=40), 3) for r in range(2)]
    assert [sum(step, []) for step in zip(*after)] == single[5:]


def test_the_samples_of_each_step_do_not_depend_on_how_the_global_batch_is_split():
    """Issue 36, item 4: a resume on another world size keeps the global batch, re-deriving the
    accumulation; the samples of step N are then the same set, in every epoch (the epoch's tail is
    cut at a whole step, not at a global micro-batch, which differs between the splits)."""
    indices, global_batch, steps = np.arange(103), 12, 26  # 96 samples an epoch: 8 steps; 26 cross 3 epochs

    def step_sets(world, micro, resume_at=0):
        accum = global_batch // (micro * world)
        ranks = [iter(ResumableBatchSampler(indices, micro, r, world, seed=3, samples_per_step=global_batch,
                                            consumed_samples=resume_at * global_batch)) for r in range(world)]
        return [sorted(sum((next(it) for _ in range(accum) for it in ranks), [])) for _ in range(steps - resume_at)]

    one = step_sets(1, 12)
    assert len({tuple(s) for s in one[:8]}) == 8 and one[:8] != one[8:16]  # real steps, reshuffled each epoch
    for world, micro in [(2, 3), (3, 1), (4, 3), (2, 1)]:  # grad_accum 2, 4, 1 and 6
        assert step_sets(world, micro) == one, (world, micro)
    # A 4-rank run resumed at step 11 (in the second epoch) on 3 ranks continues the same sets.
    assert step_sets(4, 3)[:11] + step_sets(3, 1, resume_at=11) == one
    # Cut at a global micro-batch instead, the splits part ways after the first epoch.
    split = [iter(ResumableBatchSampler(indices, 1, r, 2, seed=3)) for r in range(2)]
    assert [sorted(sum((next(it) for _ in range(6) for it in split), [])) for _ in range(steps)] != one


def test_sampler_with_dataloader(indexed):
    ds = PretrainDataset(indexed, 16)
    assert len(pickle.dumps(ds)) < 1000  # goes to DataLoader workers by path, not as a copy of the tokens
    train, _ = split_train_valid(len(ds), 0.1, seed=0)
    sampler = ResumableBatchSampler(train, 4, 0, 1, seed=0)
    expected = take(ResumableBatchSampler(train, 4, 0, 1, seed=0), 3)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=1,
                                         multiprocessing_context="spawn")
    for batch, ids in zip(loader, expected):
        assert torch.equal(batch, torch.stack([ds[i] for i in ids]))


def test_sampler_errors():
    with pytest.raises(ValueError, match=r"fewer than one step's 8 \(micro-batch 4 x 2 ranks x 1 accumulated\)"):
        ResumableBatchSampler(range(7), 4, 0, 2, seed=0)
    with pytest.raises(ValueError, match="samples_per_step=12 is not a multiple of the global micro-batch"):
        ResumableBatchSampler(range(70), 4, 0, 2, seed=0, samples_per_step=12)
    with pytest.raises(ValueError, match="rank=2"):
        ResumableBatchSampler(range(70), 4, 2, 2, seed=0)
    with pytest.raises(ValueError, match="multiple of the global micro-batch 8"):
        ResumableBatchSampler(range(70), 4, 0, 2, seed=0, consumed_samples=12)
