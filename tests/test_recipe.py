"""Training-recipe parts: model EMA (any layout, checkpointed, evaluated), layer-wise LR decay and label smoothing
under a pipeline, mixup / cutmix through timm (also under a pipeline), and fine-tuning from an exported run."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from visiondist.engine.ema import ModelEma
from visiondist.engine.logging import read_metrics
from visiondist.models.vit import VisionTransformer
from helpers import REPO, losses_of, train_args, train_ok


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
    """The images' side and the labels' side of a draw, computed apart (as a pipeline's first and last stage do),
    equal timm's Mixup applied to both at once under the same numpy seed; the loss is timm's soft-target CE."""
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
        mixed, soft = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=6)(images.clone(),
                                                                                                 labels)
        before = np.random.get_state()[1].copy()
        assert torch.equal(mixing.images(images.clone(), key), mixed)
        torch.testing.assert_close(mixing.targets(labels, key, (3, 32, 32)), soft)
        assert np.array_equal(np.random.get_state()[1], before)  # numpy's global generator is left as it was
        kinds.add("cutmix" if (mixed == images).any() else "mixup")
    assert kinds == {"cutmix", "mixup"}  # both kinds were drawn and matched
    with pytest.raises(ValueError, match="need an even one, not 3"):
        mixing.images(images[:3].clone(), (0, 0))

    task = ClassificationTask.__new__(ClassificationTask)
    task.inputs = Normalize([0.5] * 3, [0.25] * 3)  # the images below are float already: passed on as they are
    task.label_smoothing, task.mixing, task.image_shape = 0.1, mixing, (3, 32, 32)
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, num_classes=6, embed_dim=32, depth=1, num_heads=2)
    ours = task.loss(model, (images.clone(), labels), torch.device("cpu"), torch.autocast("cpu", enabled=False), (3, 1))
    expected = SoftTargetCrossEntropy()(model(mixing.images(images.clone(), (3, 1))),
                                        mixing.targets(labels, (3, 1), (3, 32, 32)))
    torch.testing.assert_close(ours, expected)
    model.eval()  # no mixing in evaluation
    plain = task.loss(model, (images, labels), torch.device("cpu"), torch.autocast("cpu", enabled=False), (3, 1))
    torch.testing.assert_close(plain, torch.nn.functional.cross_entropy(model(images), labels, label_smoothing=0.1))


def test_mixup_and_cutmix_under_a_pipeline_give_the_unpipelined_losses(tmp_path, tiny_shapes):
    """pp=2 (the first stage mixes the images, the last the labels, 4 micro-batches) against one process on the same
    global batch, with mixup and cutmix both on: the same loss at every step."""
    mix = ["model.num_heads=2", "model.depth=2", "trainer.max_steps=6", "data.mixup=0.8", "data.cutmix=1.0",
           "trainer.label_smoothing=0.1", "trainer.eval_every=0"]
    one, pp = tmp_path / "one", tmp_path / "pp"
    train_ok(*train_args(tiny_shapes, one, *mix, "parallel.dp=1"))
    train_ok(*train_args(tiny_shapes, pp, *mix, "parallel=pp2"))
    a, b = losses_of(one), losses_of(pp)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=1e-5)
    plain = tmp_path / "plain"  # and the mixing is on: without it the losses differ
    train_ok(*train_args(tiny_shapes, plain, *mix[:3], "trainer.label_smoothing=0.1", "trainer.eval_every=0",
                         "parallel.dp=1"))
    assert losses_of(plain)[2] != pytest.approx(a[2], rel=1e-3)


RECIPE = ["model.num_heads=2", "model.depth=4", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.ema_decay=0.5",
          "optim.layer_decay=0.7", "trainer.label_smoothing=0.1"]


def test_ema_layer_decay_and_smoothing_agree_across_layouts_and_resume(tmp_path, tiny_shapes):
    """One process accumulating 4 micro-batches vs pp=2 stopped after step 2 and resumed: same losses, same model
    and EMA evaluations."""
    one, pp = tmp_path / "one", tmp_path / "pp"
    train_ok(*train_args(tiny_shapes, one, *RECIPE, "parallel.dp=1", "trainer.grad_accum=4"))
    train_ok(*train_args(tiny_shapes, pp, *RECIPE, "parallel=pp2", "trainer.stop_at_step=2"))
    train_ok(*train_args(tiny_shapes, pp, *RECIPE, "parallel=pp2"))  # resume=auto: the EMA comes back too
    a, b = losses_of(one), losses_of(pp)
    assert [b[s] for s in range(1, 5)] == pytest.approx([a[s] for s in range(1, 5)], rel=1e-5)
    rows = {}
    for run in (one, pp):
        rows[run] = {int(r["step"]): r for r in read_metrics(run / "metrics.csv") if r["val_loss"] is not None}
    assert sorted(rows[one]) == sorted(rows[pp]) == [2, 4]
    for step in (2, 4):
        x, y = rows[one][step], rows[pp][step]
        assert y["val_ema_loss"] == pytest.approx(x["val_ema_loss"], rel=1e-5)
        assert y["val_ema_top1"] == x["val_ema_top1"] and y["val_top1"] == x["val_top1"]
        assert x["val_ema_loss"] != pytest.approx(x["val_loss"], rel=1e-3)  # the average is not the model
    assert "val top-1, EMA (%)" in json.loads((pp / "summary.json").read_text())
    per_class = json.loads((pp / "per_class.json").read_text())
    assert len(per_class) == 6 and sum(c["images"] for c in per_class.values()) == 30


def test_init_from_skips_a_head_of_another_size(tmp_path):
    from visiondist.models.weights import init_from

    torch.manual_seed(0)
    source = VisionTransformer(img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=1, num_heads=2)
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    target = VisionTransformer(img_size=32, patch_size=8, num_classes=6, embed_dim=32, depth=1, num_heads=2)
    head = target.head.weight.detach().clone()
    assert init_from(target, str(tmp_path / "w.safetensors")) == ["head.weight", "head.bias"]
    assert torch.equal(target.head.weight, head)
    assert torch.equal(target.blocks[0].attn.q.weight, source.blocks[0].attn.q.weight)
    deeper = VisionTransformer(img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=2, num_heads=2)
    with pytest.raises(ValueError, match="does not fit VisionTransformer: missing blocks.1"):
        init_from(deeper, str(tmp_path / "w.safetensors"))


def test_fine_tuning_from_an_exported_run_starts_at_its_accuracy(tmp_path, tiny_shapes):
    """Train, export to timm's keys, start a new run from the export: its evaluation before the first step equals the
    source run's final one."""
    source = tmp_path / "source"
    common = ["model.num_heads=2", "model.depth=2"]
    train_ok(*train_args(tiny_shapes, source, *common, "trainer.max_steps=6"))
    train_ok(f"run_dir={source}", script=REPO / "tools" / "export.py")
    exported = source / "export" / "model.safetensors"
    assert any(".attn.qkv." in k for k in load_file(exported))  # timm's keys
    tuned = tmp_path / "tuned"
    train_ok(*train_args(tiny_shapes, tuned, *common, f"model.init_from={exported}", "trainer.eval_at_start=true",
                         "trainer.max_steps=1", "optim.layer_decay=0.75"))
    final = [r for r in read_metrics(source / "metrics.csv") if r["val_loss"] is not None][-1]
    start = [r for r in read_metrics(tuned / "metrics.csv") if r["val_loss"] is not None][0]
    assert start["step"] == 0
    assert start["val_top1"] == final["val_top1"] and start["val_top5"] == final["val_top5"]
    assert start["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)
