"""Sharding by data-parallel rank: exact coverage, layout-independent global batches, exact eval
shards."""

from collections import Counter

import numpy as np
import pytest

from visiondist.data.sampler import EvalBatchSampler, TrainBatchSampler


def _epoch(n, batch, dp, accum=1, epoch=0, seed=0):
    ranks = []
    for r in range(dp):
        s = TrainBatchSampler(n, batch, r, dp, accum, seed=seed)
        s.set_epoch(epoch)
        ranks.append(list(s))
    return ranks


@pytest.mark.parametrize("dp", [2, 3])
def test_each_training_sample_once_per_epoch(dp):
    n, batch = 120, 24  # 24 divides by 2 and 3, 120 by 24
    for epoch in range(3):
        keys = [k for rank in _epoch(n, batch, dp, epoch=epoch) for mb in rank for k in mb]
        counts = Counter(i for i, _ in keys)
        assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}
        assert {e for _, e in keys} == {epoch}


def test_incomplete_batch_is_dropped_and_counted():
    n, batch, dp = 100, 24, 2
    s = TrainBatchSampler(n, batch, 0, dp)
    assert s.steps_per_epoch == 4 and s.dropped_per_epoch == 4
    seen = [set(i for mb in rank for i, _ in mb) for rank in _epoch(n, batch, dp)]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 96
    other = set(i for rank in _epoch(n, batch, dp, epoch=1) for mb in rank for i, _ in mb)
    assert other != seen[0] | seen[1]  # a different random remainder waits each epoch


@pytest.mark.parametrize("dp,accum", [(2, 1), (3, 1), (2, 2), (4, 3)])
def test_global_batch_is_the_same_for_any_dp(dp, accum):
    """Step k uses the same samples whether 1 rank or dp ranks (x accumulation) share it."""
    n, batch = 240, 24
    single = _epoch(n, batch, 1)[0]
    ranks = _epoch(n, batch, dp, accum)
    for step, ref in enumerate(single):
        got = sorted(
            k for r in ranks for k in (x for mb in r[step * accum : (step + 1) * accum] for x in mb)
        )
        assert got == sorted(ref)


def test_resume_mid_epoch_skips_taken_steps():
    full = _epoch(96, 16, 2)[1]
    s = TrainBatchSampler(96, 16, 1, 2)
    s.set_epoch(0, start_step=2)
    assert list(s) == full[2:] and len(s) == len(full) - 2


@pytest.mark.parametrize("n,dp", [(10, 3), (7, 2), (2, 3), (600, 4)])
def test_eval_covers_every_sample_exactly_once(n, dp):
    seen = [i for r in range(dp) for b in EvalBatchSampler(n, 4, r, dp) for i in b]
    assert sorted(seen) == list(range(n))
    sizes = [sum(len(b) for b in EvalBatchSampler(n, 4, r, dp)) for r in range(dp)]
    assert max(sizes) - min(sizes) <= 1


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="not divisible"):
        TrainBatchSampler(100, 10, 0, 3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TrainBatchSampler(10, 16, 0, 2)


def test_padded_shapes_are_torchvisions_and_eval_batches_hold_one_each():
    """The shape torchvision's detection transform pads each image to when alone, for 300 random
    sizes and COCO's common ones; grouped eval batches cover each rank's shard exactly once, in
    batches of one shape, for 1-3 ranks."""
    import torch
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    from visiondist.data.sampler import padded_shapes

    transform = GeneralizedRCNNTransform(800, 1333, [0.0] * 3, [1.0] * 3).eval()
    rng = np.random.default_rng(0)
    sizes = np.concatenate([rng.integers(20, 1400, (300, 2)), [[640, 480], [480, 640], [1, 999]]])
    shapes = padded_shapes(sizes, 800, 1333)
    for (width, height), shape in zip(sizes.tolist(), shapes.tolist()):
        alone = transform([torch.zeros(3, height, width)])[0].tensors.shape[-2:]
        assert list(alone) == shape, (width, height)
    groups = shapes[:, 0] * 10_000 + shapes[:, 1]
    for ranks in (1, 2, 3):
        seen = []
        for rank in range(ranks):
            sampler = EvalBatchSampler(len(sizes), 4, rank, ranks, shapes)
            batches = list(sampler)
            assert len(batches) == len(sampler)
            assert all(len({groups[i] for i in b}) == 1 and 1 <= len(b) <= 4 for b in batches)
            seen += [i for b in batches for i in b]
        assert sorted(seen) == list(range(len(sizes)))


def test_an_aspect_group_smaller_than_a_batch_is_batched_with_the_largest():
    """27 landscape and 13 portrait images in global batches of 16 (a small detection set at
    COCO's batch): the 13 portrait images could never fill a batch of their own, so they join the
    landscape group; over 8 epochs every image is trained, each batch still split alike on 1 and 2
    ranks. Groups that fill a batch stay apart."""
    from visiondist.data.sampler import joined_small_groups

    groups = np.array([1] * 27 + [0] * 13)
    np.random.default_rng(0).shuffle(groups)
    sampler = TrainBatchSampler(40, 16, 0, 1, groups=groups)
    assert sampler.joined == 13 and sampler.steps_per_epoch == 2
    seen = set()
    for epoch in range(8):
        for batch in sampler.global_batches(epoch):
            seen.update(batch.tolist())
    assert seen == set(range(40))
    two = [TrainBatchSampler(40, 16, r, 2, groups=groups) for r in range(2)]
    for r, s in enumerate(two):
        s.set_epoch(3)
        assert [i for b in s for i, _ in b] == [
            i for b in sampler.global_batches(3) for i in b[r * 8 : (r + 1) * 8].tolist()
        ]
    kept, joined = joined_small_groups(np.array([0] * 16 + [1] * 20 + [2] * 3), 16)
    assert joined == 3 and kept.tolist() == [0] * 16 + [1] * 23
    assert joined_small_groups(np.array([0] * 16 + [1] * 16), 16)[1] == 0
