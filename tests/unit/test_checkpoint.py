"""Loading a local weights file never runs pickled code; a checkpoint written under the newest
supported torch loads under the oldest. Checkpoints written and resumed by real runs:
tests/multirank/test_checkpoint.py."""

import os
from pathlib import Path

import pytest
import torch


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_local_weights_cannot_run_code(tmp_path, monkeypatch):
    from visiondist.models.weights import load_local_weights

    path = tmp_path / "weights.pt"
    torch.save({"model": _RunsCode()}, path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match="is a pickle holding more than tensors, which is never unpickled here"
    ):
        load_local_weights(torch.nn.Linear(2, 2), str(path))
    assert not (tmp_path / "pwned").exists()


# written by torch 2.15.0's dcp.save: a Linear(3, 2) (weight = arange(6) / 10, bias = [-1, 2.5])
# under "model" and its weight's transpose, stored non-contiguous, as an optimizer moment under
# "optim", as visiondist groups a checkpoint
DCP_TORCH_2_15 = Path(__file__).parent / "data" / "dcp_torch2.15"


@pytest.mark.smoke  # CI's smoke subset runs on torch 2.11, the release this matters for
# one process, as export and eval load
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_written_under_torch_2_15_loads_under_every_supported_torch():
    """torch 2.15 pickles each tensor's strides into DCP's metadata, which the reader of 2.11-2.14
    cannot unpickle (a run trained on a newer cluster, resumed or exported where the GPU image has
    2.11); through visiondist's reader every value loads as written, under whichever supported torch
    runs this test."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorProperties

    from visiondist.checkpoint.dcp import load_model_state
    from visiondist.utils.dcp import SafeFileSystemReader, read_metadata

    # torch's own reader fails here, ours must not
    if "strides" not in TensorProperties.__dataclass_fields__:
        with pytest.raises(ValueError, match="too many values to unpack"):
            FileSystemReader(str(DCP_TORCH_2_15)).read_metadata()
    stored = read_metadata(DCP_TORCH_2_15).state_dict_metadata
    assert sorted(stored) == ["model.bias", "model.weight", "optim.state.weight.exp_avg"]
    assert all(isinstance(item.properties, TensorProperties) for item in stored.values())

    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 10
    model = torch.nn.Linear(3, 2)
    load_model_state(DCP_TORCH_2_15, model)
    assert torch.equal(model.weight.detach(), weight) and torch.equal(
        model.bias.detach(), torch.tensor([-1.0, 2.5])
    )
    state = {"optim": {"state.weight.exp_avg": torch.zeros(2, 3)}}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(DCP_TORCH_2_15)), no_dist=True)
    assert torch.equal(state["optim"]["state.weight.exp_avg"], weight)


def test_resuming_another_runs_checkpoint_with_another_model_is_refused(tmp_path):
    """A checkpoint of a 4-head ViT-Tiny loads into a 3-head one without an error (the tensors'
    shapes are the same) and trains another model: trainer.resume=<checkpoint> is refused in one
    line naming the key, as continuing that run's dir is; the same model, or allow_changes, goes
    on."""
    from omegaconf import OmegaConf

    from visiondist.config import ConfigError, compose
    from visiondist.preflight.inputs import _same_model_as_checkpoint
    from visiondist.utils.dcp import METADATA, STATE_FILE

    configs = Path(__file__).resolve().parents[2] / "configs"
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_10"
    step.mkdir(parents=True)
    (step / METADATA).write_bytes(b"")
    (step / STATE_FILE).write_text("{}")
    OmegaConf.save(compose(configs, ["model=vit_tiny", "model.num_heads=4"]), run / "config.yaml")
    resume = [f"trainer.resume={step}", "model=vit_tiny"]
    with pytest.raises(
        ConfigError,
        match=r"was trained with model\.num_heads=4, this command asks model\.num_heads=3: give "
        r"model\.num_heads=4",
    ):
        _same_model_as_checkpoint(compose(configs, resume))
    _same_model_as_checkpoint(compose(configs, [*resume, "model.num_heads=4"]))
    _same_model_as_checkpoint(compose(configs, [*resume, "trainer.allow_changes=true"]))
    # the run dir names its newest checkpoint the same way
    with pytest.raises(ConfigError, match="model.num_heads=4"):
        _same_model_as_checkpoint(compose(configs, [f"trainer.resume={run}", "model=vit_tiny"]))
    # another model config: named as the command line picks it, not by its first differing key
    with pytest.raises(
        ConfigError,
        match=r"was trained with model=vit_tiny, this command asks model=vit_small: give "
        r"model=vit_tiny \(its run's model\)",
    ):
        _same_model_as_checkpoint(compose(configs, [f"trainer.resume={step}", "model=vit_small"]))
