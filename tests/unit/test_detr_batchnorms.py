"""The backbone's BatchNorms of RT-DETR and D-FINE (visiondist/models/detr_library.py): training
from random weights, frozen or not as given weights had them,
`model.kwargs.freeze_backbone_batch_norms` either way."""

import pytest
import torch

pytest.importorskip("transformers")

from helpers import detr_model_cfg as _cfg

from visiondist.models.detr_library import build_detr


def _backbone_norms(model) -> set[str]:
    return {
        type(m).__name__
        for n, m in model.named_modules()
        if ".backbone." in n and "Norm" in type(m).__name__
    }


def _all_frozen(model) -> bool:
    names = _backbone_norms(model)
    return bool(names) and all("Frozen" in name for name in names)


def _backbone_grad_norm(model) -> float:
    torch.manual_seed(0)
    images = [torch.rand(3, 128, 128) for _ in range(4)]
    targets = [
        {"boxes": torch.tensor([[10.0, 20.0, 70.0, 90.0]]), "labels": torch.tensor([1 + k % 3])}
        for k in range(4)
    ]
    model.train()(images, targets)["loss"].backward()
    return float(
        torch.stack(
            [
                p.grad.norm()
                for n, p in model.named_parameters()
                if ".backbone." in n and p.grad is not None
            ]
        ).norm()
    )


@pytest.mark.parametrize("arch", ["dfine_n", "rtdetr_v2_r18"])
def test_the_backbones_batchnorms_train_from_random_weights_and_stay_as_given_weights_had_them(
    arch, tmp_path
):
    """The library freezes the backbone's BatchNorms (right for its pretrained backbones); from
    random weights, frozen at their initial statistics they normalise nothing: D-FINE-N's backbone
    activations shrink about 10x a layer and its first gradients are orders of magnitude larger than
    with the BatchNorms training."""
    import transformers

    torch.manual_seed(0)
    fresh = build_detr(_cfg(arch))
    assert _backbone_norms(fresh) == {"BatchNorm2d"}
    torch.manual_seed(0)
    # the library's default
    frozen = build_detr(_cfg(arch, kwargs={"freeze_backbone_batch_norms": True}))
    assert _all_frozen(frozen)
    if arch == "dfine_n":
        assert _backbone_grad_norm(frozen) > 1e3 * _backbone_grad_norm(fresh)
    # weights given: the BatchNorms as they were there; a directory of the library's default
    # (frozen)
    library = transformers.AutoModelForObjectDetection.from_config(
        fresh.model.config.__class__(
            **{**fresh.model.config.to_dict(), "freeze_backbone_batch_norms": True}
        )
    )
    library.save_pretrained(tmp_path / "frozen")
    from_dir = build_detr(_cfg(arch, weights=str(tmp_path / "frozen")))
    assert _all_frozen(from_dir)
    # set either way: trainable ones take the directory's statistics (it holds no
    # num_batches_tracked)
    trainable = build_detr(
        _cfg(arch, weights=str(tmp_path / "frozen"), kwargs={"freeze_backbone_batch_norms": False})
    )
    assert _backbone_norms(trainable) == {"BatchNorm2d"}
    key = next(k for k in library.state_dict() if ".backbone." in k and k.endswith("running_var"))
    assert torch.equal(trainable.state_dict()["model." + key], library.state_dict()[key])
    # a state dict of this wrapper's keys from a run that trained them: trainable again; from one
    # that had them frozen: frozen, with its statistics
    torch.save(fresh.state_dict(), tmp_path / "run.pt")
    assert _backbone_norms(build_detr(_cfg(arch, weights=str(tmp_path / "run.pt")))) == {
        "BatchNorm2d"
    }
    torch.save(frozen.state_dict(), tmp_path / "frozen.pt")
    from_frozen = build_detr(_cfg(arch, weights=str(tmp_path / "frozen.pt")))
    assert _all_frozen(from_frozen)
    stat = "model." + key
    assert torch.equal(from_frozen.state_dict()[stat], frozen.state_dict()[stat])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_with_frozen_batchnorms_resumes_into_the_model_built_as_it_saved_them(
    tmp_path,
):
    """A run trained with the backbone's BatchNorms frozen, continued by a command whose config does
    not name the setting (the model would build them trainable): the trainer builds the model from
    the checkpoint's keys first (`freeze_as_saved`, called by `build_laid_out` with the checkpoint a
    resume reads), so its tensors and AdamW state load exactly; built trainable, the load fails
    naming the checkpoint."""
    from types import SimpleNamespace

    from visiondist.checkpoint.dcp import freeze_as_saved, load_checkpoint, save_checkpoint

    layout = SimpleNamespace(is_main=True, rank=0, world_size=1, dp=1, tp=1, pp=1)
    torch.manual_seed(0)
    frozen = build_detr(_cfg("dfine_n", kwargs={"freeze_backbone_batch_norms": True}))
    optimizer = torch.optim.AdamW(frozen.parameters(), lr=1e-4)
    _backbone_grad_norm(frozen)  # one step's gradients
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, frozen, optimizer, {"epoch": 0}, layout)

    def resumed(freeze_first: bool):
        model = build_detr(_cfg("dfine_n"))
        assert _backbone_norms(model) == {"BatchNorm2d"}
        frozen_count = freeze_as_saved(path, model) if freeze_first else 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        load_checkpoint(path, model, optimizer, layout)
        return model, optimizer, frozen_count

    with pytest.raises(
        RuntimeError, match=r"could not load checkpoint .*step_1; it lacks .*num_batches_tracked"
    ):
        resumed(freeze_first=False)
    model, again, count = resumed(freeze_first=True)
    assert (
        _all_frozen(model)
        and count == sum("Frozen" in type(m).__name__ for m in frozen.modules()) > 0
    )
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), frozen.state_dict().values())
    )
    assert list(model.state_dict()) == list(frozen.state_dict())
    stepped = [
        (p, q) for p, q in zip(model.parameters(), frozen.parameters()) if q in optimizer.state
    ]
    assert len(stepped) > 100 and all(
        torch.equal(again.state[p]["exp_avg"], optimizer.state[q]["exp_avg"]) for p, q in stepped
    )
