"""Mixup / CutMix (timm's) that the images' side and the labels' side can apply apart.

Under a pipeline the first stage holds the images and the last the labels; both must mix with the
same draw. Every draw is therefore a pure function of (seed, data-parallel rank, step, micro-batch):
each side draws it on its own, a resumed run draws what the uninterrupted one drew, and no random
state has to travel or be checkpointed. The parameters come from timm's `Mixup` (its per-batch mode:
each micro-batch mixed with its reverse) and its `cutmix_bbox_and_lam` / `mixup_target`, run on a
numpy generator seeded with that key.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def _numpy_seeded(key: tuple[int, ...]):
    """numpy's global generator seeded with `key` (timm draws from it), restored afterwards."""
    saved = np.random.get_state()
    np.random.seed([int(k) & 0xFFFFFFFF for k in key])
    try:
        yield
    finally:
        np.random.set_state(saved)


class Mixing:
    """`data.mixup` / `data.cutmix` for one data-parallel rank. `key` = (step, micro-batch index)
    names a draw."""

    def __init__(self, d, num_classes: int, label_smoothing: float, seed: int, dp_rank: int):
        # timm: 0.6 s a rank after torchvision, paid only by a run that mixes (methods below too)
        from timm.data import Mixup  # noqa: PLC0415 (timm: 0.6 s)

        self.mixup = Mixup(
            mixup_alpha=d.mixup,
            cutmix_alpha=d.cutmix,
            prob=d.mixup_prob,
            switch_prob=d.mixup_switch_prob,
            label_smoothing=label_smoothing,
            num_classes=num_classes,
        )
        self.seed, self.dp_rank = int(seed), int(dp_rank)

    def draw(
        self, key: tuple[int, int], shape: tuple[int, ...]
    ) -> tuple[float, tuple[int, int, int, int] | None]:
        """(lambda, cutmix box or None) of the draw `key` for images of `shape` (N, C, H, W): lambda
        is the share of each image (and label) that stays its own."""
        from timm.data.mixup import cutmix_bbox_and_lam  # noqa: PLC0415 (timm: 0.6 s)

        if shape[0] % 2:
            raise ValueError(
                "mixup / cutmix mix a micro-batch with its reverse and need an even one, not "
                f"{shape[0]}"
            )
        with _numpy_seeded((self.seed, self.dp_rank, *key)):
            lam, use_cutmix = self.mixup._params_per_batch()
            box = None
            if lam != 1.0 and use_cutmix:
                box, lam = cutmix_bbox_and_lam(
                    shape,
                    lam,
                    ratio_minmax=self.mixup.cutmix_minmax,
                    correct_lam=self.mixup.correct_lam,
                )
        return float(lam), box

    def images(self, x: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        """The float images `x` mixed in place, as timm's Mixup does."""
        lam, box = self.draw(key, tuple(x.shape))
        if box is not None:
            yl, yh, xl, xh = box
            x[:, :, yl:yh, xl:xh] = x.flip(0)[:, :, yl:yh, xl:xh]
        elif lam != 1.0:
            flipped = x.flip(0).mul_(1.0 - lam)
            x.mul_(lam).add_(flipped)
        return x

    def targets(
        self, labels: torch.Tensor, key: tuple[int, int], image_shape: tuple[int, int, int]
    ) -> torch.Tensor:
        """Soft targets (N, classes) of `labels` under the draw `key` (label smoothing folded in);
        `image_shape` is (C, H, W), all a CutMix box's clipping depends on."""
        from timm.data.mixup import mixup_target  # noqa: PLC0415 (timm: 0.6 s)

        lam, _ = self.draw(key, (len(labels), *image_shape))
        return mixup_target(labels, self.mixup.num_classes, lam, self.mixup.label_smoothing)
