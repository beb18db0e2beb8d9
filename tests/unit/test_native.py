"""A ViT on native-resolution patch sequences (`visiondist.models.native`): the same weights as the square model, the
square model's logits for a square image, packing that changes nothing an image computes, and timm's NaFlexVit
predicting what it does from the converted weights."""

import pytest
import torch
import torch.nn.functional as F

from visiondist.models.native import Patches, TIMM_NAFLEX, pack, patchify, timm_naflex_kwargs, to_timm_naflex
from visiondist.models.vit import VisionTransformer, to_timm_state_dict

TINY = dict(img_size=32, patch_size=8, num_classes=5, embed_dim=32, depth=2, num_heads=2, mlp_ratio=4.0)


def _model() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    with torch.no_grad():  # trained-looking embeddings: the init's are near zero and would hide a wrong position
        model.pos_embed.normal_()
        model.cls_token.normal_()
    return model


def _images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, h, w, generator=g) for h, w in ((32, 32), (40, 24), (16, 48), (24, 24), (32, 32))]


def test_patches_are_row_major_with_each_patchs_pixels_in_row_column_channel_order():
    image = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6)
    patches = patchify(image, 2)
    assert patches.shape == (2 * 3, 2 * 2 * 3)
    # patch (row 1, column 2): pixels (2..3, 4..5), each pixel's 3 channels together
    want = torch.stack([image[:, y, x] for y in (2, 3) for x in (4, 5)]).flatten()
    assert torch.equal(patches[1 * 3 + 2], want)
    with pytest.raises(ValueError, match="not a whole number of 2-pixel patches"):
        patchify(torch.zeros(3, 5, 6), 2)


def test_a_square_image_as_patches_gives_the_square_models_logits_padded_or_not():
    model = _model()
    images = _images()
    square = torch.stack([images[0], images[4]])
    with torch.no_grad():
        want = model(square)
        exact = pack([images[0], images[4]], 8, 16)
        assert not exact.padded
        padded = pack([images[0], images[4]], 8, 20)
        assert padded.padded
        torch.testing.assert_close(model(exact), want, rtol=0, atol=1e-6)
        torch.testing.assert_close(model(padded), want, rtol=0, atol=1e-6)


def test_packed_sequences_compute_each_image_as_alone_forward_and_backward():
    """Three sequences holding 1, 2 and 2 images against one image a sequence: the same logits, and the gradients of
    a loss over the images equal (attention stays inside each image, each image's class token pools its own)."""
    model = _model().train()
    images = _images()
    labels = torch.tensor([0, 1, 2, 3, 4])
    alone = pack(images, 8, 16)
    packed = pack(images, 8, 32, [[1, 3], [0], [2, 4]])
    assert packed.slots.tolist() == [[True, True], [True, False], [True, True]] and packed.num_images == 5
    order = [1, 3, 0, 2, 4]

    def run(batch, labels):
        model.zero_grad()
        logits = model(batch)
        F.cross_entropy(logits, labels, reduction="sum").backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = run(alone, labels)
    got, got_grads = run(packed, labels[order])
    torch.testing.assert_close(got, want[order], rtol=0, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_padding_changes_nothing_an_image_computes():
    model = _model()
    batch = pack(_images()[:3], 8, 28, [[0], [1, 2]])
    noise = torch.randn(batch.patches.shape) * (batch.segments == 0).unsqueeze(-1)
    with torch.no_grad():
        want = model(batch)
        got = model(batch._replace(patches=batch.patches + 100 * noise))
    assert bool((batch.segments == 0).any())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_checkpointed_blocks_take_the_mask():
    model = _model().train()
    batch = pack(_images(), 8, 32, [[1, 3], [0], [2, 4]])
    model(batch).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for block in model.blocks:
        block.checkpointing = True
    model(batch).sum().backward()
    for name, grad in want.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_batch_that_does_not_fit_is_refused():
    images = _images()
    with pytest.raises(ValueError, match="sequence 0 holds 28 patches, more than seq_len=24"):
        pack(images, 8, 24, [[0, 2], [1], [3], [4]])
    with pytest.raises(ValueError, match="each image exactly once"):
        pack(images, 8, 32, [[0], [1], [2], [3]])


def test_timm_naflexvit_loads_the_weights_strictly_and_predicts_the_same():
    timm = pytest.importorskip("timm")
    model = _model()
    images = _images()
    naflex = timm.create_model(TIMM_NAFLEX, pretrained=False, **timm_naflex_kwargs(**TINY)).eval()
    naflex.load_state_dict(to_timm_naflex(to_timm_state_dict(model.state_dict()), (4, 4)), strict=True)
    batch = pack(images, 8, 16)
    coords = torch.zeros(len(images), 16, 2, dtype=torch.long)
    for i, image in enumerate(images):
        rows, cols = image.shape[1] // 8, image.shape[2] // 8
        grid = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1).reshape(-1, 2)
        coords[i, : rows * cols] = grid
    with torch.no_grad():
        want = model(batch)
        got = naflex({"patches": batch.patches, "patch_coord": coords, "patch_valid": batch.segments > 0})
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        square = torch.stack([images[0], images[4]])
        torch.testing.assert_close(naflex(square), model(square), rtol=0, atol=1e-5)


def test_patches_move_as_one_batch():
    batch = pack(_images()[:2], 8, 16)
    moved = batch.to("cpu")
    assert isinstance(moved, Patches) and moved.grids == batch.grids and moved.padded == batch.padded
