"""Training-recipe parts in one process: the model EMA, mixup / cutmix (timm's, each side drawn
alone), a head of another size left fresh. Across layouts and runs:
tests/multirank/test_recipe.py."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from visiondist.engine.ema import ModelEma
from visiondist.models.vit import VisionTransformer


def test_ema_is_the_exponential_average_and_swaps_back_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    ema = ModelEma(model, 0.9)
    expected = [s.clone() for s in start]
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        expected = [0.9 * e + 0.1 * p.detach() for e, p in zip(expected, model.parameters())]
    for (_, shadow, _), e in zip(ema.named_shadows(), expected):
        torch.testing.assert_close(shadow, e)
    live = [p.detach().clone() for p in model.parameters()]
    with ema.swapped():
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), live))


def test_mixing_is_timms_mixup_and_each_side_draws_it_alone():
    """The images' side and the labels' side of a draw, computed apart (as a pipeline's first and
    last stage do), equal timm's Mixup applied to both at once under the same numpy seed; the loss
    is timm's soft-target CE."""
    from types import SimpleNamespace

    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    from visiondist.data.mixing import Mixing
    from visiondist.data.transforms import Normalize
    from visiondist.engine.tasks import ClassificationTask

    d = SimpleNamespace(mixup=0.8, cutmix=1.0, mixup_prob=1.0, mixup_switch_prob=0.5)
    mixing = Mixing(d, num_classes=6, label_smoothing=0.1, seed=7, dp_rank=1)
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 5])
    kinds = set()
    for step in range(12):
        key = (step, 1)
        np.random.seed([7, 1, step, 1])
        mixed, soft = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=6)(
            images.clone(), labels
        )
        before = np.random.get_state()[1].copy()
        assert torch.equal(mixing.images(images.clone(), key), mixed)
        torch.testing.assert_close(mixing.targets(labels, key, (3, 32, 32)), soft)
        # numpy's global generator is left as it was
        assert np.array_equal(np.random.get_state()[1], before)
        kinds.add("cutmix" if (mixed == images).any() else "mixup")
    assert kinds == {"cutmix", "mixup"}  # both kinds were drawn and matched
    with pytest.raises(ValueError, match="need an even one, not 3"):
        mixing.images(images[:3].clone(), (0, 0))

    task = ClassificationTask.__new__(ClassificationTask)
    # the images below are float already: passed on as they are
    task.inputs = Normalize([0.5] * 3, [0.25] * 3)
    task.label_smoothing, task.mixing, task.image_shape = 0.1, mixing, (3, 32, 32)
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=32, patch_size=8, num_classes=6, embed_dim=32, depth=1, num_heads=2
    )
    ours = task.loss(
        model,
        (images.clone(), labels),
        torch.device("cpu"),
        torch.autocast("cpu", enabled=False),
        (3, 1),
    )
    expected = SoftTargetCrossEntropy()(
        model(mixing.images(images.clone(), (3, 1))), mixing.targets(labels, (3, 1), (3, 32, 32))
    )
    torch.testing.assert_close(ours, expected)
    model.eval()  # no mixing in evaluation
    plain = task.loss(
        model, (images, labels), torch.device("cpu"), torch.autocast("cpu", enabled=False), (3, 1)
    )
    torch.testing.assert_close(
        plain, torch.nn.functional.cross_entropy(model(images), labels, label_smoothing=0.1)
    )


def test_init_from_skips_a_head_of_another_size(tmp_path):
    from visiondist.models.weights import init_from

    torch.manual_seed(0)
    source = VisionTransformer(
        img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=1, num_heads=2
    )
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    target = VisionTransformer(
        img_size=32, patch_size=8, num_classes=6, embed_dim=32, depth=1, num_heads=2
    )
    head = target.head.weight.detach().clone()
    assert init_from(target, str(tmp_path / "w.safetensors")) == ["head.weight", "head.bias"]
    assert torch.equal(target.head.weight, head)
    assert torch.equal(target.blocks[0].attn.q.weight, source.blocks[0].attn.q.weight)
    deeper = VisionTransformer(
        img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=2, num_heads=2
    )
    with pytest.raises(ValueError, match="does not fit VisionTransformer: missing blocks.1"):
        init_from(deeper, str(tmp_path / "w.safetensors"))


def test_the_one_call_ema_update_is_timms_model_ema():
    """The EMA updates every parameter in one multi-tensor lerp (`torch._foreach_lerp_`), and after
    20 optimizer steps holds what timm's `ModelEmaV3` (what the benchmark's plain loop uses)
    holds."""
    from timm.utils import ModelEmaV3

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ours, theirs = ModelEma(model, 0.9), ModelEmaV3(model, decay=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
        ours.update()
        theirs.update(model)
    for (name, shadow, _), (their_name, value) in zip(
        ours.named_shadows(), theirs.module.named_parameters()
    ):
        assert name == their_name
        torch.testing.assert_close(shadow, value, rtol=1e-6, atol=1e-7)
