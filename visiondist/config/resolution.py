"""data.resolution=native's settings, resolved without torch: the sequence lengths
(`native_settings`), the tokens the memory plan counts per image (`planned_tokens`) and the rules
between config groups (`check_native`). The loader that applies them is `visiondist.data.native`."""

from __future__ import annotations

import dataclasses
import math

from visiondist.config.schema import ConfigError, NativeConfig

# data.native.pack: a training image takes this share of its step's length (uniform); the mean, 1/4,
# makes a packed step's image count 4x the unpacked one's, a multiple of dp x grad_accum wherever
# that is
PACK_SHARE = (0.1, 0.4)


def native_settings(data_cfg, img_size: int, patch: int) -> tuple[list[int], int]:
    """(training sequence lengths, evaluation sequence length): `data.native.seq_lens` /
    `eval_seq_len`, or by default half, once and twice the square model's token count, and that
    count."""
    base = (img_size // patch) ** 2
    native = data_cfg.get("native") or {}
    lens = list(native.get("seq_lens") or [base // 2, base, 2 * base])
    eval_len = int(native.get("eval_seq_len") or -1)
    return sorted(int(n) for n in lens), (base if eval_len <= 0 else eval_len)


def token_budget(batch: int, img_size: int, patch: int) -> int:
    """A native step's patch tokens: `batch` square images' worth (the sampler's and the plan's
    budget)."""
    return int(batch) * (int(img_size) // int(patch)) ** 2


def reading(data_cfg, img_size: int, patch: int) -> str:
    """How a classifier reads an image at evaluation and prediction (their log lines, predict.json):
    `square, 224 px` or `native at 196 patches an image`."""
    if data_cfg.get("resolution", "square") != "native":
        return f"square, {int(img_size)} px"
    return f"native at {native_settings(data_cfg, img_size, patch)[1]} patches an image"


def _check_square(native) -> None:
    """A square run's data.native.*: its defaults (`NativeConfig`) only, since it would change
    nothing."""
    asked = []
    for key, default in dataclasses.asdict(NativeConfig()).items():
        value = native.get(key, default)
        if (list(value) if isinstance(default, list) else value) != default:
            asked.append(
                f"data.native.{key}={str(value).lower() if isinstance(value, bool) else value}"
            )
    if asked:
        raise ConfigError(
            f"{' '.join(asked)} reads images at their own shape: add data.resolution=native, or "
            "drop it (this run reads square crops)"
        )


def check_native(cfg) -> None:
    """data.resolution's rules between groups (`visiondist.config.validate`): data.native.* only
    with data.resolution=native, and native's own; raises ConfigError."""
    d, m = cfg.data, cfg.model
    if d.get("resolution", "square") == "square":
        _check_square(d.get("native") or {})
        return
    if d.resolution != "native":
        raise ConfigError(f"data.resolution={d.resolution}: use square or native")
    if m.family != "vit":
        raise ConfigError(
            f"data.resolution=native trains a ViT classifier on patch sequences; model={m.name} "
            "takes images: use data.resolution=square"
        )
    lens = [int(n) for n in d.native.seq_lens]
    if any(n <= 0 for n in lens):
        raise ConfigError(
            f"data.native.seq_lens={lens}: token counts are positive ([] or unset: half, once and "
            "twice the square model's count)"
        )
    if d.native.eval_seq_len == 0 or d.native.eval_seq_len < -1:
        raise ConfigError(
            f"data.native.eval_seq_len={d.native.eval_seq_len}: a token count is positive (-1: the "
            "square model's count)"
        )
    side = int(m.img_size) // int(m.patch_size)
    budget = token_budget(d.batch_size, m.img_size, m.patch_size)
    if lens and max(lens) > budget:
        raise ConfigError(
            f"data.native.seq_lens has {max(lens)} patches, more than a step's token budget of "
            f"{budget} (data.batch_size={d.batch_size} square images of {side * side} patches): "
            f"use lengths up to {budget}, or a larger data.batch_size"
        )
    refused = [
        (
            d.mixup > 0 or d.cutmix > 0,
            "data.mixup / data.cutmix mix images of one size",
            "data.mixup=0 data.cutmix=0",
        ),
        (
            d.random_erasing > 0,
            "data.random_erasing erases square batches on the device",
            "data.random_erasing=0",
        ),
        (
            d.auto_augment != "none" and d.augment_on == "device",
            "data.augment_on=device augments square batches",
            "data.augment_on=loader (each image augmented in the workers)",
        ),
        (
            d.decode_on == "device",
            "data.decode_on=device decodes to one square size",
            "data.decode_on=loader",
        ),
        (
            m.sdpa == "flash",
            "model.sdpa=flash takes no attention mask, and padded or packed sequences need one",
            "model.sdpa=auto (or efficient)",
        ),
        (
            cfg.parallel.pp > 1,
            "a pipeline's stages pass one tensor of one shape between ranks, and a native "
            "batch is patches, masks and positions of a shape that changes each step",
            "parallel.pp=1 (DDP, FSDP or parallel.tp)",
        ),
    ]
    for refuse, why, fix in refused:
        if refuse:
            raise ConfigError(
                f"data.resolution=native: {why}; use {fix}, or data.resolution=square"
            )


def mean_share(packed: bool) -> float:
    """An image's mean share of its sequence's length: 1, or packed the middle of `PACK_SHARE`."""
    return sum(PACK_SHARE) / 2 if packed else 1.0


def step_images(budget: int, seq_len: int, packed: bool, unit: int = 1) -> int:
    """The images of a training step of `seq_len` tokens under a budget of `budget` patch tokens:
    budget / seq_len (packed: over the mean share an image takes of its sequence, `PACK_SHARE`),
    rounded to the nearest and then down to a multiple of `unit` (dp x grad_accum), at least one
    unit. The sampler's count; with unit 1, the most any layout's step holds (the memory plan's)."""
    return max(unit, round(budget / (seq_len * mean_share(packed))) // unit * unit)


def planned_tokens(cfg) -> int:
    """The tokens per image of data.batch_size that the most costly native step computes (each of
    its images' patches and class token, over the global batch, rounded up): the memory plan's
    tokens per image."""
    m = cfg.model
    seq_lens, _ = native_settings(cfg.data, int(m.img_size), int(m.patch_size))
    batch = int(cfg.data.batch_size)
    budget = token_budget(batch, m.img_size, m.patch_size)
    packed = bool((cfg.data.get("native") or {}).get("pack", False))
    return max(
        math.ceil(step_images(budget, n, packed) * (n * mean_share(packed) + 1) / batch)
        for n in seq_lens
    )
