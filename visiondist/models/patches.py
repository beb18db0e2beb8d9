"""ViTs at their images' own resolution and aspect ratio (NaViT, Dehghani et al. 2023; timm's
NaFlexViT): a batch is fixed-length sequences of patches, each image cut at its own size into a grid
of patches, one or several images to a sequence (packing), the rest padding.

`Patches` is such a batch, `pack` makes one from images; a `VisionTransformer` takes it in place of
a square batch (`VisionTransformer.forward`), with the same weights:

- the patch embedding is the same linear map over each patch's pixels (the convolution's weight,
  read in the patches' (row, column, channel) order, timm NaFlex's);
- each image's position embedding is the learned grid interpolated to the image's grid (bicubic with
  antialiasing, as timm's NaFlexViT), looked up at each patch's coordinates; the class token's is
  its own, as in the square model;
- every image has its class token, at the front of its sequence, and attention stays inside each
  image (padding sees only padding), so the logits are the class tokens' and pool over that image's
  patches only.

A square image given as `Patches` gives the square model's logits (to round-off), so a run trained
square continues native and back. `to_timm_naflex` writes the weights as timm's `NaFlexVit` holds
them (`timm_naflex_kwargs` builds one that loads them strictly).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

# the fields of `Patches` that are tensors (what `to` and `pin_memory` move)
_TENSORS = ("patches", "segments", "pos_index", "slots", "order")


class Patches(NamedTuple):
    """A batch of B sequences of N patch tokens holding at most S images each (`pack` makes one).

    - patches: (B, N, p * p * C) each patch's pixels in (row, column, channel) order;
    - segments: (B, N) long: 0 for padding, k >= 1 for the k-th image of its sequence;
    - pos_index: (B, N) long: each token's row in the position table of `grids` (concatenated,
      row-major);
    - slots: (B, S) bool: image slot k - 1 of sequence b holds an image;
    - order: (images,) long: the filled slots' positions in the flattened (B * S) slots, sequence
      by sequence: the order of the model's logits (a gather by index: no read of the slots on the
      host, as a boolean mask's indexing would be on a GPU);
    - grids: the distinct (rows, columns) grids of the batch's images, in the position table's
      order;
    - padded: some token is padding, or a sequence holds more than one image (attention needs a
      mask).
    """

    patches: torch.Tensor
    segments: torch.Tensor
    pos_index: torch.Tensor
    slots: torch.Tensor
    order: torch.Tensor
    grids: tuple[tuple[int, int], ...]
    padded: bool

    @property
    def num_images(self) -> int:
        return len(self.order)

    def to(self, device, non_blocking: bool = False) -> Patches:
        return self._replace(
            **{name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TENSORS}
        )

    def pin_memory(self) -> Patches:
        return self._replace(**{name: getattr(self, name).pin_memory() for name in _TENSORS})


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """(C, H, W) with H and W multiples of `patch` -> (H/p * W/p, p * p * C), patches row-major,
    each patch's pixels in (row, column, channel) order."""
    c, h, w = image.shape
    if h % patch or w % patch:
        raise ValueError(f"a {h}x{w} image is not a whole number of {patch}-pixel patches")
    return (
        image.reshape(c, h // patch, patch, w // patch, patch)
        .permute(1, 3, 2, 4, 0)
        .reshape((h // patch) * (w // patch), patch * patch * c)
    )


def pack(
    images: Sequence[torch.Tensor],
    patch: int,
    seq_len: int,
    sequences: Sequence[Sequence[int]] | None = None,
) -> Patches:
    """`images` ((C, H, W), sides multiples of `patch`) as a `Patches` batch of sequences of
    `seq_len` tokens. `sequences`: the image indices of each sequence, in order (default: one image
    to a sequence). The logits of `VisionTransformer(batch)` follow `[i for seq in sequences for i
    in seq]`."""
    sequences = (
        [[i] for i in range(len(images))] if sequences is None else [list(s) for s in sequences]
    )
    if sorted(i for s in sequences for i in s) != list(range(len(images))):
        raise ValueError("sequences must hold each image exactly once")
    grids = [(im.shape[1] // patch, im.shape[2] // patch) for im in images]
    distinct = list(dict.fromkeys(grids))
    offsets, at = {}, 0
    for grid in distinct:
        offsets[grid], at = at, at + grid[0] * grid[1]
    b, s = len(sequences), max(len(seq) for seq in sequences)
    channels = images[0].shape[0] if images else 3
    patches = torch.zeros(
        b, seq_len, patch * patch * channels, dtype=images[0].dtype if images else torch.float32
    )
    segments = torch.zeros(b, seq_len, dtype=torch.long)
    pos_index = torch.zeros(b, seq_len, dtype=torch.long)
    slots = torch.zeros(b, s, dtype=torch.bool)
    padded = s > 1
    for row, seq in enumerate(sequences):
        start = 0
        for k, i in enumerate(seq):
            n = grids[i][0] * grids[i][1]
            if start + n > seq_len:
                raise ValueError(
                    f"sequence {row} holds {start + n} patches, more than seq_len={seq_len}"
                )
            patches[row, start : start + n] = patchify(images[i], patch)
            segments[row, start : start + n] = k + 1
            pos_index[row, start : start + n] = torch.arange(
                offsets[grids[i]], offsets[grids[i]] + n
            )
            slots[row, k] = True
            start += n
        padded = padded or start < seq_len
    order = torch.tensor(
        [row * s + k for row, seq in enumerate(sequences) for k in range(len(seq))],
        dtype=torch.long,
    )
    return Patches(patches, segments, pos_index, slots, order, tuple(distinct), padded)


def position_table(
    pos_embed: torch.Tensor, grid: tuple[int, int], grids: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """The patches' position embeddings (`pos_embed` (1, 1 + rows * cols, D), class token first)
    resampled to each of `grids` and concatenated, row-major: (sum of h * w, D). Bicubic with
    antialiasing, as timm's NaFlexViT."""
    patches = pos_embed[0, 1:]
    square = patches.reshape(1, grid[0], grid[1], -1).permute(0, 3, 1, 2).float()
    parts = []
    for h, w in grids:
        if (h, w) == tuple(grid):
            parts.append(patches)
        else:
            resized = F.interpolate(
                square, size=(h, w), mode="bicubic", align_corners=False, antialias=True
            )
            parts.append(resized.flatten(2)[0].t().to(pos_embed.dtype))
    return torch.cat(parts)


def attention_mask(batch: Patches) -> torch.Tensor | None:
    """Which tokens of [class tokens (S), patches (N)] attend to which: None when nothing is padded
    and each sequence holds one image; with one image a sequence, the valid keys (B, 1, 1, S + N);
    else pairs in the same image (B, 1, S + N, S + N), padding (and empty class slots) seeing only
    padding."""
    if not batch.padded:
        return None
    s = batch.slots.shape[1]
    cls = (
        torch.arange(1, s + 1, device=batch.segments.device).expand(batch.slots.shape) * batch.slots
    )
    segments = torch.cat([cls, batch.segments], dim=1)
    if s == 1:
        return (segments > 0)[:, None, None, :]
    return (segments[:, :, None] == segments[:, None, :])[:, None]


def native_embed(model, batch: Patches) -> torch.Tensor:
    """The tokens [class tokens, patches] (B, S + N, D) of `batch` for a `VisionTransformer`."""
    embed = model.patch_embed
    weight = embed.proj.weight
    x = F.linear(
        batch.patches.to(weight.dtype), weight.permute(0, 2, 3, 1).flatten(1), embed.proj.bias
    )
    side = embed.img_size // embed.patch_size
    table = position_table(model.pos_embed, (side, side), batch.grids)
    x = x + table[batch.pos_index] * (batch.segments > 0).unsqueeze(-1).to(x.dtype)
    b, s = batch.slots.shape
    cls = (model.cls_token + model.pos_embed[:, :1]).expand(b, s, -1)
    return torch.cat([cls, x], dim=1)


def native_forward(model, batch: Patches) -> torch.Tensor:
    """A `VisionTransformer`'s logits (images, classes) of the images of `batch`, in its slots'
    order."""
    x = model.blocks(native_embed(model, batch), attention_mask(batch))
    s = batch.slots.shape[1]
    logits = model.head(model.head_drop(model.norm(x[:, :s])))
    return logits.flatten(0, 1).index_select(0, batch.order)


def to_timm_naflex(
    state: dict[str, torch.Tensor], grid: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """A ViT's weights in timm's layout (`visiondist.models.vit.to_timm_state_dict`) as timm's
    `NaFlexVit` holds them: the patch embedding a linear map over (row, column, channel) pixels, the
    position grid (1, rows, cols, D) and the class token's position added to the class token (what
    timm's own conversion does)."""
    out = {}
    for key, value in state.items():
        if key == "pos_embed":
            out["embeds.pos_embed"] = value[:, 1:].reshape(1, grid[0], grid[1], -1).clone()
        elif key == "cls_token":
            out["embeds.cls_token"] = value + state["pos_embed"][:, :1]
        elif key == "patch_embed.proj.weight":
            out["embeds.proj.weight"] = value.permute(0, 2, 3, 1).flatten(1).contiguous()
        elif key == "patch_embed.proj.bias":
            out["embeds.proj.bias"] = value
        else:
            out[key] = value
    return out


# a NaFlexVit without layer scale or register tokens, set as ours below
TIMM_NAFLEX = "naflexvit_base_patch16_siglip"


def timm_naflex_kwargs(
    img_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    num_heads: int,
    mlp_ratio: float,
    num_classes: int,
) -> dict:
    """`timm.create_model(TIMM_NAFLEX, **kwargs)`: the NaFlexVit of this ViT (class-token pooling,
    GELU, bicubic position resampling), which loads `to_timm_naflex`'s weights strictly."""
    return dict(
        img_size=img_size,
        patch_size=patch_size,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_ratio,
        num_classes=num_classes,
        class_token=True,
        global_pool="token",
        fc_norm=False,
        pos_embed_grid_size=(img_size // patch_size,) * 2,
        act_layer="gelu",
        pos_embed_interp_mode="bicubic",
    )
