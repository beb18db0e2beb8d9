"""data.resolution=native's loader (`visiondist.data.native`): timm's grid rule, every rank's steps
and images an epoch, the sample's own crop, padding and packing into sequences, and the image counts
the memory plan takes from the sampler."""

import math

import pytest
import torch


@pytest.mark.parametrize(
    "height,width",
    [(480, 640), (640, 480), (100, 2000), (33, 33), (224, 224), (7, 900), (62, 66), (42, 97)],
)
@pytest.mark.parametrize("seq_len", [16, 49, 196, 256])
def test_the_grid_keeps_the_aspect_ratio_and_is_timms(height, width, seq_len):
    """The grid an image is resized to fits the length, keeps the aspect ratio to a patch, and is
    the one timm's NaFlex transforms choose (so that timm's loader feeds a `format=naflex` export
    the run's grids)."""
    from timm.data.naflex_transforms import get_image_size_for_seq

    from visiondist.data.native import fit_grid

    rows, cols = fit_grid(height, width, 16, seq_len)
    assert 1 <= rows * cols <= seq_len
    assert (rows * 16, cols * 16) == get_image_size_for_seq((height, width), 16, seq_len)[1]
    if min(rows, cols) > 2:  # the aspect kept to a patch
        assert abs(cols / rows - width / height) <= max(width / height / rows, 1 / rows) + 1e-9


def test_every_rank_gets_the_same_steps_and_each_image_once_an_epoch():
    """Steps of varying length and image count, the same on every DP rank; over the ranks each image
    of the epoch's steps once; the same images whatever the number of ranks (the one-process
    run's)."""
    from visiondist.data.native import NativeBatchSampler

    def keys(dp, accum, epoch):
        out = []
        for rank in range(dp):
            sampler = NativeBatchSampler(1000, 32, 196, [98, 196, 392], rank, dp, accum, seed=3)
            sampler.set_epoch(epoch)
            out.append(list(sampler))
        return sampler, out

    one, (alone,) = keys(1, 1, 0)
    assert sorted(set(one.lens)) == [98, 196, 392] and one.steps_per_epoch == len(alone)
    # 32 x 196 tokens / 98
    assert {one.step_images[i] for i, n in enumerate(one.lens) if n == 98} == {64}
    assert {one.step_images[i] for i, n in enumerate(one.lens) if n == 392} == {16}
    for dp, accum in ((2, 1), (4, 2)):
        sampler, ranks = keys(dp, accum, 0)
        # the same steps on every rank
        assert sampler.lens == one.lens and len({len(r) for r in ranks}) == 1
        for step in range(one.steps_per_epoch):
            micro = [ranks[r][step * accum + a] for r in range(dp) for a in range(accum)]
            assert {len(m) for m in micro} == {one.step_images[step] // (dp * accum)}
            assert {k[2] for m in micro for k in m} == {one.lens[step]}
            # the one-process step's images, in its order
            assert [k for m in micro for k in m] == alone[step]
    seen = [k[0] for m in alone for k in m]
    assert len(seen) == len(set(seen)) == 1000 - one.dropped_per_epoch
    # what is left out is less than the smallest step (16 images at 392 tokens)
    assert one.dropped_per_epoch < 16
    for n in (122, 130, 500):  # a small set too: 122 images at batch 32 left 58 out before
        small = NativeBatchSampler(n, 32, 36, [18, 36, 72], 0, 1, seed=0)
        assert small.dropped_per_epoch < min(small.step_images), (n, small.dropped_per_epoch)
    _, (other,) = keys(1, 1, 1)
    # reshuffled, same steps
    assert [len(m) for m in other] == [len(m) for m in alone] and other != alone
    assert one.images(0, one.steps_per_epoch) == 1000 - one.dropped_per_epoch
    assert one.images(1, 3) == one.step_images[1] + one.step_images[2]
    assert (
        one.images(one.steps_per_epoch - 1, one.steps_per_epoch + 1)
        == one.step_images[-1] + one.step_images[0]
    )


def test_a_resumed_epoch_continues_with_the_steps_not_taken():
    from visiondist.data.native import NativeBatchSampler

    whole = NativeBatchSampler(500, 16, 196, [98, 196, 392], 0, 1, seed=0)
    whole.set_epoch(2)
    resumed = NativeBatchSampler(500, 16, 196, [98, 196, 392], 0, 1, seed=0)
    resumed.set_epoch(2, start_step=3)
    assert list(resumed) == list(whole)[3:] and len(resumed) == whole.steps_per_epoch - 3


def test_the_transform_is_the_samples_own_and_keeps_its_aspect():
    import numpy as np
    from omegaconf import OmegaConf

    from visiondist.data.native import NativeTransform, fit_grid

    cfg = OmegaConf.create(
        {
            "train_crop_scale": [0.5, 1.0],
            "hflip": 0.5,
            "interpolation": "bilinear",
            "auto_augment": "none",
            "random_erasing": 0.0,
        }
    )
    image = np.random.default_rng(0).integers(0, 255, (300, 500, 3), dtype=np.uint8)
    train = NativeTransform(cfg, True, 16, seed=1, eval_seq_len=196)
    (a, n), (b, _), (c, _) = train(image, 7, 0, 98), train(image, 7, 0, 98), train(image, 8, 0, 98)
    assert torch.equal(a, b) and a.dtype == torch.uint8 and a.shape[2] == 3 and n == 98
    assert not (a.shape == c.shape and torch.equal(a, c))  # another sample, another crop
    assert (
        a.shape[0] % 16 == 0
        and a.shape[1] % 16 == 0
        and (a.shape[0] // 16) * (a.shape[1] // 16) <= 98
    )
    # RandomResizedCrop's draw: the area in the scale, the aspect in 3/4..4/3
    for index in range(200):
        train.random.reset(1, 0, index)
        top, left, h, w = train.crop(300, 500)
        assert 0 <= top <= 300 - h and 0 <= left <= 500 - w
        assert 0.5 * 0.98 <= h * w / (300 * 500) <= 1.0 and 3 / 4 * 0.97 <= w / h <= 4 / 3 * 1.03, (
            h,
            w,
        )
    evaluated = NativeTransform(cfg, False, 16, seed=1, eval_seq_len=196)(image, 7, 0)
    rows, cols = evaluated.shape[0] // 16, evaluated.shape[1] // 16
    # the whole image, no crop
    assert rows * cols <= 196 and (rows, cols) == fit_grid(300, 500, 16, 196)


def test_the_collate_pads_or_packs_a_batch_with_its_labels_in_order():
    from visiondist.data.native import NativeCollate

    g = torch.Generator().manual_seed(0)
    samples = [
        (torch.randint(0, 255, (h, w, 3), dtype=torch.uint8, generator=g), label)
        for (h, w), label in (((32, 48), 0), ((16, 16), 1), ((48, 32), 2), ((16, 32), 3))
    ]
    padded, labels = NativeCollate(16, [4, 8])(samples)
    assert padded.patches.shape == (4, 8, 16 * 16 * 3) and labels.tolist() == [0, 1, 2, 3]
    assert (padded.segments > 0).sum(1).tolist() == [6, 1, 6, 2]
    packed, labels = NativeCollate(16, [4, 8], pack_images=True)(samples)
    assert packed.patches.shape[:2] == (2, 8) and packed.num_images == 4
    # first fit, largest first: 6 (image 0), 6 (image 2) open two sequences; 2 (image 3) joins the
    # first, 1 the second
    assert labels.tolist() == [0, 3, 2, 1] and packed.segments.tolist() == [
        [1] * 6 + [2] * 2,
        [1] * 6 + [2, 0],
    ]
    assert packed.order.tolist() == [0, 1, 2, 3] and padded.order.tolist() == [0, 1, 2, 3]
    # the pixels of an image's first patch, in (row, column, channel) order
    assert torch.equal(packed.patches[1, 0].view(16, 16, 3), samples[2][0][:16, :16])


def test_the_plan_counts_the_images_the_sampler_puts_in_a_step():
    """The memory plan's tokens per image come from the sampler's own image count (`step_images`),
    rounded as the sampler rounds: 40 patch tokens over sequences of 7 is 5.7 images, which the
    sampler makes 6, not 5."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config.resolution import PACK_SHARE, planned_tokens
    from visiondist.data.native import NativeBatchSampler

    for packed, lens in ((False, [7]), (False, [2, 7, 9]), (True, [5, 7])):
        cfg = load_config(
            REPO / "configs",
            [
                "model=vit_tiny",
                "data.img_size=32",
                "model.patch_size=16",
                "data.batch_size=10",
                "data.resolution=native",
                f"data.native.seq_lens={lens}",
                f"data.native.pack={packed}",
            ],
            inputs=None,
        )
        share = sum(PACK_SHARE) / 2 if packed else 1.0
        sampler = NativeBatchSampler(1000, 10, 4, lens, 0, 1, packed=packed)
        most = max(
            math.ceil(k * (n * share + 1) / 10) for k, n in zip(sampler.step_images, sampler.lens)
        )
        assert planned_tokens(cfg) == most, (packed, lens)
    assert NativeBatchSampler(1000, 10, 4, [7], 0, 1).step_images[0] == 6


def test_packed_training_draws_each_images_size_and_packs_into_its_steps_length():
    """data.native.pack: each training image's patch count drawn in PACK_SHARE of its step's length,
    so that several share a sequence of that length; a step holds 1 / mean share as many images for
    the same tokens."""
    import numpy as np
    from omegaconf import OmegaConf

    from visiondist.data.native import (
        PACK_SHARE,
        NativeBatchSampler,
        NativeCollate,
        NativeTransform,
    )

    cfg = OmegaConf.create(
        {
            "train_crop_scale": [0.5, 1.0],
            "hflip": 0.5,
            "interpolation": "bilinear",
            "auto_augment": "none",
            "random_erasing": 0.0,
        }
    )
    image = np.random.default_rng(0).integers(0, 255, (300, 500, 3), dtype=np.uint8)
    transform = NativeTransform(cfg, True, 16, seed=1, eval_seq_len=196, pack=True)
    samples = [(*transform(image, i, 0, 196), i % 3) for i in range(12)]
    samples = [(im, label, n) for im, n, label in samples]
    sizes = [(im.shape[0] // 16) * (im.shape[1] // 16) for im, _, _ in samples]
    # drawn, not filled
    assert all(1 <= n <= PACK_SHARE[1] * 196 for n in sizes) and len(set(sizes)) > 3
    batch, labels = NativeCollate(16, [98, 196, 392], pack_images=True)(samples)
    assert batch.patches.shape[1] == 196 and batch.num_images == 12 and batch.patches.shape[0] < 12
    assert sorted(labels.tolist()) == sorted(s[1] for s in samples)
    one = NativeBatchSampler(10_000, 64, 196, [98, 196, 392], 0, 1)
    packed = NativeBatchSampler(10_000, 64, 196, [98, 196, 392], 0, 1, packed=True)
    assert packed.lens == one.lens[: len(packed.lens)]  # the same draws of the lengths
    for a, b in zip(one.step_images, packed.step_images):
        assert b == int(a / (sum(PACK_SHARE) / 2))
