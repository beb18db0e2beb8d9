"""A ViT on native-resolution patch sequences (`visiondist.models.patches`): the same weights as the
square model, the square model's logits for a square image, packing that changes nothing an image
computes, timm's NaFlexVit predicting what it does from the converted weights; the settings a native
run refuses, its compilation and memory plan, and its training step reading nothing on the host. The
loader: test_native_loader.py."""

import re

import pytest
import torch
import torch.nn.functional as F

from visiondist.models.patches import (
    TIMM_NAFLEX,
    Patches,
    pack,
    patchify,
    timm_naflex_kwargs,
    to_timm_naflex,
)
from visiondist.models.vit import VisionTransformer, to_timm_state_dict

TINY = dict(
    img_size=32, patch_size=8, num_classes=5, embed_dim=32, depth=2, num_heads=2, mlp_ratio=4.0
)


def _model() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    # trained-looking embeddings: the init's are near zero and would hide a wrong position
    with torch.no_grad():
        model.pos_embed.normal_()
        model.cls_token.normal_()
    return model


def _images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(3, h, w, generator=g)
        for h, w in ((32, 32), (40, 24), (16, 48), (24, 24), (32, 32))
    ]


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
    """Three sequences holding 1, 2 and 2 images against one image a sequence: the same logits, and
    the gradients of a loss over the images equal (attention stays inside each image, each image's
    class token pools its own)."""
    model = _model().train()
    images = _images()
    labels = torch.tensor([0, 1, 2, 3, 4])
    alone = pack(images, 8, 16)
    packed = pack(images, 8, 32, [[1, 3], [0], [2, 4]])
    assert (
        packed.slots.tolist() == [[True, True], [True, False], [True, True]]
        and packed.num_images == 5
    )
    # the filled slots of the flattened (3 x 2) slots
    assert packed.order.tolist() == [0, 1, 2, 4, 5]
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
        torch.testing.assert_close(
            model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-7, msg=name
        )


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
    naflex.load_state_dict(
        to_timm_naflex(to_timm_state_dict(model.state_dict()), (4, 4)), strict=True
    )
    batch = pack(images, 8, 16)
    coords = torch.zeros(len(images), 16, 2, dtype=torch.long)
    for i, image in enumerate(images):
        rows, cols = image.shape[1] // 8, image.shape[2] // 8
        grid = torch.stack(
            torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1
        ).reshape(-1, 2)
        coords[i, : rows * cols] = grid
    with torch.no_grad():
        want = model(batch)
        got = naflex(
            {"patches": batch.patches, "patch_coord": coords, "patch_valid": batch.segments > 0}
        )
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        square = torch.stack([images[0], images[4]])
        torch.testing.assert_close(naflex(square), model(square), rtol=0, atol=1e-5)


def test_patches_move_as_one_batch():
    batch = pack(_images()[:2], 8, 16)
    moved = batch.to("cpu")
    assert (
        isinstance(moved, Patches) and moved.grids == batch.grids and moved.padded == batch.padded
    )


# --- the loader (visiondist.data.native)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "native,packed",
    [(False, False), (True, False), (True, True)],
    ids=["square", "one_image_a_sequence", "packed"],
)
def test_a_native_training_step_never_reads_the_device_on_the_host(tmp_path, native, packed):
    """The trainer's step on native batches (the collate, the normalisation of the patches, the
    forward, the loss per image, the backward, clipping and the optimizer), recorded on the CPU: no
    operator that would make the host wait for a GPU (a boolean mask's indexing picking the images'
    logits did, forward and backward), as none in the square step the GPU test checks
    (tests/multirank/test_gpu.py, `never_waits`). The default logging reads the loss every 10 steps,
    so the recorded steps read none. data.num_workers=0: the collate runs in this process, where its
    reads would be recorded too (in workers they are host tensors and cost nothing). The layouts'
    steps: tests/multirank/test_layouts.py."""
    from helpers import REPO, TINY_DATA
    from host_reads import steps_reading_the_host

    from visiondist.cli import load_config
    from visiondist.launch import launch

    args = [
        *TINY_DATA,
        "data.synthetic.max_aspect=3",
        "model.patch_size=8",
        "model.num_heads=2",
        f"data.resolution={'native' if native else 'square'}",
        f"data.batch_size={2 if packed else 8}",
        f"data.native.pack={packed}",
        f"data.root={tmp_path / 'data'}",
        f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "trainer.max_steps=20",
    ]
    launch(steps_reading_the_host, load_config(REPO / "configs", args))


@pytest.mark.parametrize(
    "override,says",
    [
        ("model=fasterrcnn_mobilenet_v3", "model=fasterrcnn_mobilenet_v3 takes images"),
        ("data.mixup=0.8", "data.mixup / data.cutmix mix images of one size"),
        ("data.random_erasing=0.25", "data.random_erasing=0"),
        ("data.auto_augment=rand", "data.augment_on=loader"),
        ("parallel.pp=2", "use parallel.pp=1"),
        (
            "data.native.seq_lens=[0,196]",
            "data.native.seq_lens=[0, 196]: token counts are positive",
        ),
        ("data.native.eval_seq_len=0", "data.native.eval_seq_len=0: a token count is positive"),
        (
            "data.native.seq_lens=[100000]",
            "data.native.seq_lens has 100000 patches, more than a step's token budget of "
            "1024 (data.batch_size=64 square images of 16 patches): use lengths up to "
            "1024, or a larger data.batch_size",
        ),
        ("model.sdpa=flash", "model.sdpa=flash takes no attention mask"),
    ],
)
def test_settings_native_resolution_cannot_take_are_refused_naming_the_fix(override, says):
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config.schema import ConfigError
    from visiondist.config.validate import validate

    with pytest.raises(ConfigError, match=re.escape(says)):
        validate(
            load_config(REPO / "configs", ["data.resolution=native", override], inputs=None),
            mandatory=False,
        )


@pytest.mark.parametrize(
    "override",
    ["data.native.pack=true", "data.native.seq_lens=[98]", "data.native.eval_seq_len=98"],
)
def test_native_settings_on_a_square_run_are_refused_naming_the_fix(override):
    """A data.native.* setting without data.resolution=native would change nothing the run does:
    refused, naming both fixes."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config.schema import ConfigError
    from visiondist.config.validate import validate

    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"{override} reads images at their own shape: add data.resolution=native, or drop it"
        ),
    ):
        validate(load_config(REPO / "configs", [override], inputs=None), mandatory=False)


def test_native_runs_compile_each_block_and_refuse_the_whole_model_graph(monkeypatch):
    """trainer.compile=auto on CUDA compiles a native run's blocks (the embedding's grids change
    every batch, the blocks see a few lengths); compile=model and CUDA graphs are refused naming
    blocks. The compiled blocks take the packed sequences of three lengths in at most two graphs
    (the second dynamic) and give eager's logits."""
    import torch.utils._triton as triton
    from helpers import REPO
    from torch._dynamo.testing import CompileCounterWithBackend

    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.config.layout import RunLayout
    from visiondist.parallel import compile_blocks
    from visiondist.plan.compiling import compile_plan

    def plan(*extra):
        return compile_plan(
            load_config(REPO / "configs", ["data.resolution=native", *extra], inputs=None),
            RunLayout("cuda", 1, 1, 1),
        )

    # the plan asks whether Triton is there, as on a GPU machine; dynamo asks it too, so the
    # stand-in ends here
    with monkeypatch.context() as patched:
        patched.setattr(triton, "has_triton", lambda *args, **kwargs: True)
        assert plan("model=vit_small")[:3] == (True, "blocks", False)
        for asked in ("trainer.compile=model", "trainer.cuda_graphs=true"):
            with pytest.raises(ConfigError, match="use trainer.compile=blocks"):
                plan("model=vit_small", asked)

    torch._dynamo.reset()
    model = _model()
    images = _images()
    # one run packs or pads throughout: here packed, at three lengths and batch sizes
    batches = [
        pack(images, 8, 32, [[1, 3], [0], [2, 4]]),
        pack(images, 8, 48, [[0, 1, 2], [3, 4]]),
        pack(images[:4], 8, 40, [[0, 2], [1, 3]]),
    ]
    with torch.no_grad():
        want = [model(b) for b in batches]
        counter = CompileCounterWithBackend("aot_eager")
        compile_blocks(model, backend=counter)
        got = [model(b) for b in batches]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert 1 <= counter.frame_count <= 2
    torch._dynamo.reset()


def test_the_memory_plan_of_a_native_run_counts_its_most_costly_steps_tokens():
    """A native step holds data.batch_size x the square grid's tokens, plus a class token per image:
    at the shortest length (half the grid) twice the images, so a little more than the square step.
    The plan counts that, not the square images; the parameters are the square model's."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config.layout import RunLayout
    from visiondist.config.resolution import planned_tokens
    from visiondist.plan.budget import layout_memory, planned_shape

    base = ["model=vit_base", "data.img_size=224", "data.batch_size=256"]
    square = load_config(REPO / "configs", base, inputs=None)
    native = load_config(REPO / "configs", [*base, "data.resolution=native"], inputs=None)
    # 512 images of 98 patches + a class token each, over 256
    assert planned_tokens(native) == 196 + 2
    long = load_config(
        REPO / "configs",
        [*base, "data.resolution=native", "data.native.seq_lens=[49]"],
        inputs=None,
    )
    assert planned_tokens(long) == 196 + 4
    run = RunLayout("cuda", 1, 1, 1)
    a, b = layout_memory(square, run), layout_memory(native, run)
    assert (
        b.state == a.state
        and planned_shape(native).pos_tokens == planned_shape(square).tokens == 197
    )
    assert (
        b.activations == pytest.approx(a.activations * 198 / 197, rel=0.01)
        and b.activations > a.activations
    )


def test_tools_benchmark_refuses_native_resolution_naming_the_benchmark_that_measures_it(capsys):
    from helpers import call_tool

    code, out, err = call_tool(
        capsys, "benchmark", "data.resolution=native", "trainer.accelerator=cpu"
    )
    assert code == 2 and "benchmarks/native.py" in (out + "\n".join(err)), (code, out, err)
