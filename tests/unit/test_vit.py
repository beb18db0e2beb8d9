"""Our ViT equals timm's VisionTransformer: same logits from the same weights, state dicts convert
both ways."""

import pytest
import timm
import torch
from helpers import REPO

from visiondist.config import compose
from visiondist.models import build_model
from visiondist.models.vit import VisionTransformer, from_timm_state_dict, to_timm_state_dict

VARIANTS = ["vit_tiny", "vit_small", "vit_base", "vit_large", "vit_huge", "vit_giant"]


def _pair(img_size=64, num_classes=7):
    torch.manual_seed(0)
    ours = VisionTransformer(
        img_size=img_size,
        patch_size=16,
        num_classes=num_classes,
        embed_dim=192,
        depth=3,
        num_heads=3,
    )
    ref = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        num_classes=num_classes,
        img_size=img_size,
        depth=3,
    )
    return ours.eval(), ref.eval()


def test_timm_weights_give_timm_logits():
    ours, ref = _pair()
    ours.load_state_dict(from_timm_state_dict(ref.state_dict()), strict=True)
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        diff = (ours(x) - ref(x)).abs().max().item()
    assert diff <= 1e-5, diff


def test_our_weights_load_into_timm_strictly_and_match():
    ours, ref = _pair()
    torch.manual_seed(1)
    ours.reset_parameters()
    converted = to_timm_state_dict(ours.state_dict())
    assert set(converted) == set(ref.state_dict())
    ref.load_state_dict(converted, strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= 1e-5
    back = from_timm_state_dict(converted)
    for key, value in ours.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("name", VARIANTS)
def test_configs_have_timm_shapes(name):
    """Every model config builds exactly the tensors timm's namesake has (checked on the meta
    device, no memory)."""
    cfg = compose(REPO / "configs", [f"model={name}", "data.img_size=224", "data.num_classes=1000"])
    with torch.device("meta"):
        ours = build_model(cfg.model)
        ref = timm.create_model(cfg.model.timm_name, pretrained=False, num_classes=1000)
    ours_shapes = {k: v.shape for k, v in to_timm_state_dict(ours.state_dict()).items()}
    ref_shapes = {k: v.shape for k, v in ref.state_dict().items()}
    assert ours_shapes == ref_shapes


def test_fused_qkv_is_one_gemm_with_timms_gradients_and_three_projections_in_the_state():
    """q, k and v run as one GEMM (their weights concatenated, as timm's fused qkv): the logits and
    every gradient equal the three-GEMM path's (`fuse_qkv = False`) and timm's, whose qkv gradient
    is ours concatenated; the state dict keeps q / k / v (checkpoints and tensor-parallel shards by
    heads are unchanged)."""
    from visiondist.models.vit import Attention

    ours, ref = _pair()
    ours.train(), ref.train()
    ours.load_state_dict(from_timm_state_dict(ref.state_dict()), strict=True)
    apart = VisionTransformer(
        img_size=64, patch_size=16, num_classes=7, embed_dim=192, depth=3, num_heads=3
    ).train()
    apart.load_state_dict(ours.state_dict())
    for module in apart.modules():
        if isinstance(module, Attention):
            module.fuse_qkv = False
    x = torch.randn(4, 3, 64, 64)
    losses = [model(x).square().mean() for model in (ours, apart, ref)]
    for loss in losses:
        loss.backward()
    # other GEMM shapes (fused and split q/k/v, timm's) sum in other orders: fp32 round-off, a few
    # 1e-7 of the loss
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5)
    assert losses[0].item() == pytest.approx(losses[2].item(), rel=1e-5)
    grads = {n: p.grad for n, p in ours.named_parameters()}
    for name, param in apart.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6)
    ref_grads = from_timm_state_dict({n: p.grad for n, p in ref.named_parameters()})
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6)
    assert {"blocks.0.attn.q.weight", "blocks.0.attn.k.bias", "blocks.0.attn.v.weight"} <= set(
        ours.state_dict()
    )
    assert not any("qkv" in key for key in ours.state_dict())


def test_patch_embedding_is_the_convolution_computed_as_a_gemm():
    """The patch embedding runs as a GEMM over the image's patches, with the Conv2d's own weight:
    the same values as the convolution (kernel = stride = patch), also where the image size leaves
    pixels the stride does not reach."""
    import torch.nn.functional as F

    for img_size, patch in ((64, 16), (70, 16), (42, 14)):
        torch.manual_seed(0)
        model = VisionTransformer(
            img_size=img_size, patch_size=patch, num_classes=3, embed_dim=48, depth=1, num_heads=2
        )
        x = torch.randn(2, 3, img_size, img_size)
        conv = model.patch_embed.proj
        expected = F.conv2d(x, conv.weight, conv.bias, stride=patch).flatten(2).transpose(1, 2)
        got = model.patch_embed(x)
        assert got.shape == expected.shape == (2, (img_size // patch) ** 2, 48)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # model.channels_last=true feeds these
        channels_last = x.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(model.patch_embed(channels_last), expected, rtol=1e-5, atol=1e-5)


def test_the_whole_model_compiles_to_one_training_graph_with_drop_path_and_no_break():
    """torch.compile of the whole ViT (`trainer.compile=model`) with stochastic depth at a different
    rate per block: 20 training steps make one graph for training (the keep probabilities are
    buffers, not floats dynamo would specialise on), with no graph break and no recompile-limit hit,
    read from dynamo's counters; the compiled losses are eager's under the same random draws.
    Dynamo's graphs and guards do not depend on the backend: aot_eager traces forward and backward
    without Inductor's minute of C++ compiling (the end-to-end training test compiles with
    Inductor)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from visiondist.engine.hooks.compile import compile_counts
    from visiondist.parallel import compile_model

    def build():
        torch.manual_seed(0)
        return VisionTransformer(
            img_size=32,
            patch_size=8,
            num_classes=5,
            embed_dim=32,
            depth=4,
            num_heads=2,
            drop_path_rate=0.3,
        ).train()

    eager, compiled = build(), build()
    torch._dynamo.reset()
    counters.clear()
    compile_model(compiled, backend="aot_eager")
    x = torch.randn(20, 6, 3, 32, 32)
    for step in range(20):
        losses = []
        for model in (eager, compiled):
            torch.manual_seed(step)  # the same drop-path draws for both
            loss = model(x[step]).logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), step
    graphs, faults = compile_counts()
    assert graphs == 1 and faults == {}, (graphs, faults)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
