"""Loading a local weights file never runs pickled code. Checkpoints written and resumed by real runs:
tests/multirank/test_checkpoint.py."""

import os

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
    with pytest.raises(ValueError, match="is a pickle holding more than tensors, which is never unpickled here"):
        load_local_weights(torch.nn.Linear(2, 2), str(path))
    assert not (tmp_path / "pwned").exists()
