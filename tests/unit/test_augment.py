"""Auto-augmentation and random erasing: the loader ops are torchvision's, the batched device ops
give the loader ops' pixels for the same per-sample parameters, the draws follow torchvision's and
timm's policies, and one sample's random choices come from one stream (a flip does not follow the
crop's area)."""

from __future__ import annotations

import random

import cv2
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from visiondist.data.augment import (
    OPS,
    SIGNED,
    AugmentParams,
    AugmentPolicy,
    loader_op,
    op_argument,
)
from visiondist.data.augment_ops import apply_operations, erase, hash_normal
from visiondist.data.transforms import ClassificationTransform


def _photos(size: int = 48) -> list[torch.Tensor]:
    """Real photographs (scikit-image ships them), resized: edges, skin, sky and saturated
    colours."""
    from skimage import data

    out = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        image = cv2.resize(getattr(data, name)(), (size, size), interpolation=cv2.INTER_AREA)
        out.append(torch.from_numpy(image).permute(2, 0, 1).contiguous())
    return out


def _torchvision(policy: str):
    from torchvision.transforms import v2

    return v2.RandAugment() if policy == "rand" else v2.TrivialAugmentWide()


@pytest.mark.smoke  # the policies follow the installed torchvision's (0.26 on the GPU machines)
@pytest.mark.parametrize("policy", ["rand", "trivial"])
def test_magnitude_bins_are_torchvisions(policy):
    ours, theirs = AugmentPolicy(policy, 48).space, _torchvision(policy)._AUGMENTATION_SPACE
    assert set(ours) == set(theirs) == set(OPS)
    for op, (bins, signed) in theirs.items():
        values = bins(31, 48, 48)
        assert (ours[op] is None) == (values is None), op
        if values is not None:
            assert ours[op] == [float(v) for v in values], op
        assert (op in SIGNED) == signed, op


def _cases(policy: str, op: str, count: int, seed: int):
    """(signed magnitude, argument) pairs over the op's bins, both signs where it has one."""
    r, bins = random.Random(seed), AugmentPolicy(policy, 48).space[op]
    for _ in range(count):
        magnitude = 0.0 if bins is None else bins[r.randrange(31)]
        if op in SIGNED and r.random() < 0.5:
            magnitude = -magnitude
        yield magnitude, op_argument(op, magnitude)


@pytest.mark.smoke
@pytest.mark.parametrize("policy", ["rand", "trivial"])
def test_device_ops_give_the_loader_ops_pixels(policy):
    """Each op, 24 samples of 4 photos at random bins and signs: the loader op equals torchvision's
    policy applying that magnitude, exactly; the batched device op equals the loader op to at most 1
    grey level on at most 0.5% of the values: a blend (Color, Contrast, Brightness, Sharpness) may
    round once more than torchvision's `alpha` add, which Color's shows on these photos on every CPU
    seen so far, and the others could on another."""
    photos = _photos()
    tv = _torchvision(policy)
    from torchvision.transforms.v2 import InterpolationMode

    layout = AugmentParams(1)
    for index, op in enumerate(OPS):
        rows, expected = [], []
        for j, (magnitude, arg) in enumerate(_cases(policy, op, 24, index)):
            image = photos[j % 4]
            reference = tv._apply_image_or_video_transform(
                image, op, magnitude, InterpolationMode.NEAREST, tv._fill
            )
            mine = loader_op(image, op, arg)
            assert torch.equal(mine, reference), (op, magnitude)
            expected.append(mine)
            row = np.zeros(layout.width)
            row[:2] = index, arg
            rows.append(row)
        batch = torch.stack([photos[j % 4] for j in range(24)])
        out = apply_operations(batch.clone(), torch.from_numpy(np.stack(rows)), layout)
        # a blend's float result is truncated to uint8: where it lands on a whole level, one
        # rounding more or less (a fused multiply-add in one kernel and not the other, which the
        # CPU's vector width decides) moves it a level; Color meets it on these photos, the others
        # may on another CPU. A wrong op moves many pixels by many
        diff = (out.int() - torch.stack(expected).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.005, (
            op,
            int(diff.max()),
            float((diff > 0).float().mean()),
        )


def test_a_policy_row_applies_the_same_in_the_worker_and_on_the_device():
    """Whole rows as the worker draws them (RandAugment, 2 rounds): the loader path and the device
    path agree."""
    photos = _photos(64)
    policy = AugmentPolicy("rand", 64)
    rows = [policy.draw(random.Random(i)) for i in range(32)]
    loader = torch.stack([policy.apply_loader(photos[i % 4], rows[i]) for i in range(32)])
    device = apply_operations(
        torch.stack([photos[i % 4] for i in range(32)]),
        torch.from_numpy(np.stack(rows)),
        policy.layout,
    )
    diff = (loader.int() - device.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.005
    # something was applied
    assert not torch.equal(device, torch.stack([photos[i % 4] for i in range(32)]))


def test_draws_follow_the_policies():
    """Over 3,000 draws: every op drawn, RandAugment at its fixed bin, TrivialAugment over its bins,
    signs both ways; erasing about as often as asked, boxes inside the crop with timm's area
    range."""
    rand, trivial = AugmentPolicy("rand", 224, random_erasing=0.25), AugmentPolicy("trivial", 224)
    rows = np.stack([rand.draw(random.Random(i)) for i in range(3000)])
    assert set(rows[:, 0].astype(int)) == set(rows[:, 2].astype(int)) == set(range(len(OPS)))
    brightness = rows[rows[:, 0] == OPS.index("Brightness"), 1]
    assert set(np.round(brightness, 6)) == {
        round(1 + v, 6) for v in (rand.space["Brightness"][9], -rand.space["Brightness"][9])
    }
    erased = rows[:, 4] > 0
    assert 0.22 < erased.mean() < 0.28
    top, left, h, w = rows[erased, 5:9].T
    assert (
        (top >= 0).all()
        and (left >= 0).all()
        and (top + h <= 224).all()
        and (left + w <= 224).all()
    )
    assert (h * w >= 0.02 * 224 * 224 * 0.9).all() and (h * w <= 224 * 224 / 3 * 1.1).all()
    wide = np.stack([trivial.draw(random.Random(i)) for i in range(3000)])
    # 31 bins, two signs
    assert len(set(np.round(wide[wide[:, 0] == OPS.index("Rotate"), 1], 6))) > 40
    assert np.array_equal(rand.draw(random.Random(7)), rand.draw(random.Random(7)))


def test_erasing_fills_only_the_box_with_its_seeded_noise():
    layout = AugmentParams(0)
    images = torch.zeros(3, 3, 32, 32)
    rows = torch.zeros(3, layout.width, dtype=torch.float64)
    rows[0] = torch.tensor([1, 4, 6, 10, 12, 99], dtype=torch.float64)
    rows[2] = torch.tensor([1, 0, 0, 32, 31, 5], dtype=torch.float64)
    out = erase(images.clone(), rows, layout, "pixel")
    assert torch.equal(out[0, :, 4:14, 6:18], hash_normal(99, (3, 10, 12), out.device))
    mask = torch.ones_like(out[0], dtype=torch.bool)
    mask[:, 4:14, 6:18] = False
    assert (out[0][mask] == 0).all() and (out[1] == 0).all()
    noise = hash_normal(1234, (200_000,), torch.device("cpu"))
    assert abs(float(noise.mean())) < 0.01 and abs(float(noise.std()) - 1) < 0.01
    assert not torch.equal(
        hash_normal(1, (50,), torch.device("cpu")), hash_normal(2, (50,), torch.device("cpu"))
    )
    const = erase(torch.ones(3, 3, 32, 32), rows, layout, "const")
    assert (const[0, :, 4:14, 6:18] == 0).all() and (const[1] == 1).all()


def test_batched_erasing_equals_each_box_filled_on_its_own():
    """Many erased samples in several chunks (96 px: 303 samples per chunk of ~8 M values, so 700
    take three), boxes at the edges and whole-image boxes: each box holds `hash_normal` of its seed
    and shape (`pixel`) or one normal colour per channel (`rand`); the rest is untouched."""
    policy = AugmentPolicy("none", 96, random_erasing=0.7)
    rows = torch.from_numpy(np.stack([policy.draw(random.Random(i)) for i in range(700)]))
    rows[0, policy.layout.erase_slice()] = torch.tensor([1, 0, 0, 96, 96, 3], dtype=torch.float64)
    rows[1, policy.layout.erase_slice()] = torch.tensor([1, 95, 90, 1, 6, 4], dtype=torch.float64)
    base = torch.randn(700, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    for mode in ("pixel", "rand"):
        expected = base.clone()
        for i, (flag, top, left, h, w, seed) in enumerate(
            rows[:, policy.layout.erase_slice()].long().tolist()
        ):
            if flag:
                shape = (3, h, w) if mode == "pixel" else (3, 1, 1)
                expected[i, :, top : top + h, left : left + w] = hash_normal(
                    seed, shape, base.device
                ).expand(3, h, w)
        assert torch.equal(erase(base.clone(), rows, policy.layout, mode), expected), mode
    assert 300 < int((rows[:, policy.layout.erase_slice()][:, 0] > 0).sum()) < 700


def _transform(**data):
    cfg = OmegaConf.create(
        {
            **dict(
                train_crop_scale=[0.08, 1.0],
                hflip=0.5,
                crop_pct=1.0,
                interpolation="bilinear",
                auto_augment="none",
                augment_on="device",
                random_erasing=0.0,
                random_erasing_mode="pixel",
            ),
            **data,
        }
    )
    return ClassificationTransform(cfg, train=True, size=32, seed=0)


def test_one_stream_per_sample_a_flip_does_not_follow_the_crop():
    """Transforms seeded alike draw alike: with a seed per transform, the flip (p=0.5) took the
    crop's first uniform and every flipped image was a small crop. One stream per sample: flipped
    and unflipped crops have the same sizes on average."""
    t = _transform()
    ramp = np.zeros((100, 100, 3), np.uint8)
    ramp[..., 0] = np.arange(100)[None, :]
    ramp[..., 1] = np.arange(100)[:, None]
    flipped, area = [], []
    for i in range(600):
        out = t(ramp, i, 0).permute(2, 0, 1).numpy().astype(int)
        flipped.append(out[0, 0, 0] > out[0, 0, -1])
        area.append((out[0].max() - out[0].min() + 1) * (out[1].max() - out[1].min() + 1))
    flipped, area = np.array(flipped), np.array(area)
    assert 0.4 < flipped.mean() < 0.6
    assert abs(area[flipped].mean() / area[~flipped].mean() - 1) < 0.2
    assert torch.equal(t(ramp, 5, 1), t(ramp, 5, 1)) and not torch.equal(
        t(ramp, 5, 1), t(ramp, 5, 2)
    )


def test_the_worker_ships_parameters_and_applies_them_only_on_the_loader_path():
    # the transform takes and hands over H, W, C
    photo = _photos(96)[0].permute(1, 2, 0).numpy().copy()
    device, loader = (
        _transform(auto_augment="rand"),
        _transform(auto_augment="rand", augment_on="loader"),
    )
    for i in range(8):
        (a, row_a), (b, row_b) = device(photo, i, 3), loader(photo, i, 3)
        assert torch.equal(row_a, row_b)
        on_device = apply_operations(
            a.permute(2, 0, 1)[None].contiguous(), row_a[None], device.policy.layout
        )[0]
        b = b.permute(2, 0, 1)
        diff = (on_device.int() - b.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.005
    assert isinstance(_transform()(photo, 0, 0), torch.Tensor)  # nothing to ship: the image alone


def test_the_device_augmentation_runs_as_many_operations_for_any_batch_size():
    """The DeiT recipe's device work (RandAugment 2 rounds, normalisation, random erasing) launches
    a number of operations that does not grow with the batch: every operation is applied to all the
    samples that drew it at once, every erased box of a chunk in one pass. Counted as the aten calls
    torch dispatches (one launch each on a GPU), for batches of 28 and 112 whose samples draw each
    of the 14 operations in both rounds and are all erased."""
    from omegaconf import OmegaConf
    from torch.utils._python_dispatch import TorchDispatchMode

    from visiondist.data.augment_ops import DeviceAugment
    from visiondist.data.transforms import Normalize

    class Count(TorchDispatchMode):  # the calls that compute (a view launches nothing)
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if (
                torch.Tag.view_copy not in func.tags
                and not func.is_view
                and func.namespace == "aten"
            ):
                self.calls += 1
            return func(*args, **(kwargs or {}))

    d = OmegaConf.create(
        dict(
            auto_augment="rand",
            random_erasing=1.0,
            random_erasing_mode="pixel",
            augment_on="device",
        )
    )
    augment, normalize = DeviceAugment(d, 32), Normalize([0.5] * 3, [0.25] * 3)

    def calls(n: int) -> int:
        rows = np.stack([augment.policy.draw(random.Random(i)) for i in range(n)])
        for k in range(augment.policy.layout.rounds):  # every operation in every round, whatever n
            rows[:, 2 * k] = np.arange(n) % len(OPS)
        rows[:, 2 * augment.policy.layout.rounds] = 1.0  # every sample erased (its drawn box)
        rows[:, 2 * augment.policy.layout.rounds + 1 : 2 * augment.policy.layout.rounds + 5] = [
            4,
            4,
            8,
            8,
        ]
        images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8)
        with Count() as count:
            augment(images, torch.from_numpy(rows), torch.device("cpu"), normalize)
        return count.calls

    calls(14)  # first calls initialise (torchvision's version checks)
    small, large = calls(28), calls(112)
    # 2 rounds x 14 operations + normalising + erasing
    assert small == large and small < 500, (small, large)


def test_the_soft_target_loss_is_timms_in_one_call():
    """Mixed targets go through `F.cross_entropy` with class probabilities, one call instead of
    timm's `SoftTargetCrossEntropy` (log-softmax, product, sum, mean): the same loss and
    gradient."""
    from timm.data.mixup import mixup_target
    from timm.loss import SoftTargetCrossEntropy

    from visiondist.engine.tasks import ClassificationTask

    logits = torch.randn(16, 10, generator=torch.Generator().manual_seed(0), requires_grad=True)
    target = mixup_target(torch.arange(16) % 10, 10, lam=0.7, smoothing=0.1)
    task = ClassificationTask.__new__(ClassificationTask)
    task.label_smoothing = 0.1
    ours = task.criterion(logits, target)
    (grad,) = torch.autograd.grad(ours, logits)
    theirs = SoftTargetCrossEntropy()(logits, target)
    (their_grad,) = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, their_grad, rtol=1e-5, atol=1e-8)
