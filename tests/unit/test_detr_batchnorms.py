"""The backbone's BatchNorms of RT-DETR and D-FINE (visiondist/models/detr_library.py): training from random
weights, frozen or not as given weights had them, `model.kwargs.freeze_backbone_batch_norms` either way."""

import pytest
import torch

pytest.importorskip("transformers")

from helpers import detr_model_cfg as _cfg  # noqa: E402
from visiondist.models.detr_library import build_detr  # noqa: E402


def _backbone_norms(model) -> set[str]:
    return {type(m).__name__ for n, m in model.named_modules() if ".backbone." in n and "Norm" in type(m).__name__}


def _all_frozen(model) -> bool:
    names = _backbone_norms(model)
    return bool(names) and all("Frozen" in name for name in names)


def _backbone_grad_norm(model) -> float:
    torch.manual_seed(0)
    images = [torch.rand(3, 128, 128) for _ in range(4)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 70.0, 90.0]]), "labels": torch.tensor([1 + k % 3])}
               for k in range(4)]
    model.train()(images, targets)["loss"].backward()
    return float(torch.stack([p.grad.norm() for n, p in model.named_parameters()
                              if ".backbone." in n and p.grad is not None]).norm())


@pytest.mark.parametrize("arch", ["dfine_n", "rtdetr_v2_r18"])
def test_the_backbones_batchnorms_train_from_random_weights_and_stay_as_given_weights_had_them(arch, tmp_path):
    """The library freezes the backbone's BatchNorms (right for its pretrained backbones); from random weights,
    frozen at their initial statistics they normalise nothing: D-FINE-N's backbone activations shrink about 10x a
    layer and its first gradients are orders of magnitude larger than with the BatchNorms training."""
    import transformers

    torch.manual_seed(0)
    fresh = build_detr(_cfg(arch))
    assert _backbone_norms(fresh) == {"BatchNorm2d"}
    torch.manual_seed(0)
    frozen = build_detr(_cfg(arch, kwargs={"freeze_backbone_batch_norms": True}))  # the library's default
    assert _all_frozen(frozen)
    if arch == "dfine_n":
        assert _backbone_grad_norm(frozen) > 1e3 * _backbone_grad_norm(fresh)
    # weights given: the BatchNorms as they were there; a directory of the library's default (frozen)
    library = transformers.AutoModelForObjectDetection.from_config(fresh.model.config.__class__(
        **{**fresh.model.config.to_dict(), "freeze_backbone_batch_norms": True}))
    library.save_pretrained(tmp_path / "frozen")
    from_dir = build_detr(_cfg(arch, weights=str(tmp_path / "frozen")))
    assert _all_frozen(from_dir)
    # set either way: trainable ones take the directory's statistics (it holds no num_batches_tracked)
    trainable = build_detr(_cfg(arch, weights=str(tmp_path / "frozen"), kwargs={"freeze_backbone_batch_norms": False}))
    assert _backbone_norms(trainable) == {"BatchNorm2d"}
    key = next(k for k in library.state_dict() if ".backbone." in k and k.endswith("running_var"))
    assert torch.equal(trainable.state_dict()["model." + key], library.state_dict()[key])
    # a state dict of this wrapper's keys from a run that trained them: trainable again; from one that had them
    # frozen: frozen, with its statistics
    torch.save(fresh.state_dict(), tmp_path / "run.pt")
    assert _backbone_norms(build_detr(_cfg(arch, weights=str(tmp_path / "run.pt")))) == {"BatchNorm2d"}
    torch.save(frozen.state_dict(), tmp_path / "frozen.pt")
    from_frozen = build_detr(_cfg(arch, weights=str(tmp_path / "frozen.pt")))
    assert _all_frozen(from_frozen)
    stat = "model." + key
    assert torch.equal(from_frozen.state_dict()[stat], frozen.state_dict()[stat])
