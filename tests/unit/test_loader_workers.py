"""visiondist.data.workers.watched: a batch lost to a dead loader worker is reported as the worker's
death, naming how it died, not as multiprocessing's bare EOFError (tests/multirank/test_failures.py
kills a real worker; when the rank is receiving that worker's last batch, this is the error it
gets), in training and in evaluation."""

import signal
from types import SimpleNamespace

import pytest

from visiondist.data.workers import watched


class Batches:
    """A loader iterator whose next batch fails as receiving a dead worker's batch does."""

    def __init__(self, workers, error=EOFError):
        self._workers, self.error, self.served = workers, error, 0

    def __next__(self):
        if self.served:
            raise self.error()
        self.served += 1
        return "batch 1"


def _worker(pid, alive_for, exitcode):
    """Seen alive `alive_for` times (the exit not yet reaped), then dead with `exitcode`."""
    calls = iter(range(10_000))
    return SimpleNamespace(pid=pid, exitcode=exitcode, is_alive=lambda: next(calls) < alive_for)


def test_a_killed_worker_is_named_with_its_signal():
    batches = watched(Batches([_worker(11, 10_000, None), _worker(12, 3, -signal.SIGKILL)]))
    assert next(batches) == "batch 1"
    with pytest.raises(
        RuntimeError,
        match=r"^DataLoader worker \(pid\(s\) 12\) exited unexpectedly: killed by signal "
        r"SIGKILL \(what the kernel's OOM killer sends: lower data.num_workers",
    ) as e:
        next(batches)
    assert isinstance(e.value.__cause__, EOFError)


def test_a_reset_connection_with_every_worker_alive_is_raised_as_it_is():
    batches = watched(Batches([_worker(11, 10_000, None)], error=ConnectionResetError))
    next(batches)
    with pytest.raises(ConnectionResetError):
        next(batches)
    exited = watched(Batches([_worker(13, 0, 3)]))
    next(exited)
    with pytest.raises(RuntimeError, match=r"pid\(s\) 13\) exited unexpectedly: exit code 3$"):
        next(exited)


class _Loader:
    """An evaluation loader whose first batch is lost to a worker the OOM killer took."""

    def __init__(self):
        self.batch_sampler = SimpleNamespace(batch_size=2)

    def __len__(self):
        return 3

    def __iter__(self):
        batches = Batches([_worker(21, 2, -signal.SIGKILL)])
        batches.served = 1
        return batches


def test_evaluation_names_a_dead_loader_worker_too():
    import torch

    from visiondist.evaluation.classification import evaluate_classification
    from visiondist.evaluation.detection import predict
    from visiondist.models.vit import VisionTransformer

    layout = SimpleNamespace(
        device=torch.device("cpu"), dp=1, is_main=True, all_reduce_dp=lambda t: t
    )
    model = VisionTransformer(
        img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=1, num_heads=2
    )
    dead = r"DataLoader worker \(pid\(s\) 21\) exited unexpectedly: killed by signal SIGKILL"
    with pytest.raises(RuntimeError, match=dead):
        evaluate_classification(model, _Loader(), layout, progress=False)
    with pytest.raises(RuntimeError, match=dead):
        predict(model, _Loader(), torch.device("cpu"), {}, progress=True)
