"""`python tests/multirank/fault_train.py [train.py arguments]`: tools/train.py with one fault
injected into the real code path (VISIONDIST_TOOL=eval / export: tools/eval.py / tools/export.py
instead).

The fault is named by the environment variable VISIONDIST_FAULT, `<kind>[:<n>]`. The patches are
applied when this module is imported: in the launching process, in the ranks the elastic launcher
spawns (which import the main module again as `__mp_main__`) and in their loader workers (forked
from the ranks). Nothing else differs from a user's run.

The kinds, and what happens:
- `getitem_raise:n`: a training sample's `__getitem__` raises once a worker has served `n` samples
  (0: the first batch);
- `getitem_hang:n`: ... sleeps forever instead (a hung file system);
- `worker_kill:n`: ... the worker SIGKILLs itself (what the OOM killer does);
- `eval_raise`: the evaluation raises;
- `save_fail:n`: the n-th checkpoint write (1-based) raises an OSError after writing part of its
  files;
- `rank_hang:n`: rank 1 stops at optimizer step n and never joins the next collective;
- `rank_kill:n`: rank 1 SIGKILLs itself at optimizer step n (as the OOM killer does), touching
  VISIONDIST_SLOW_MARK.<pid>;
- `cuda_oom:n`: rank 1 raises the CUDA caching allocator's out-of-memory error (its message) at
  optimizer step n;
- `slow_step:n`: optimizer step n takes VISIONDIST_SLOW_S seconds longer (default 40) on every rank;
- `slow_eval`: an evaluation takes VISIONDIST_SLOW_S seconds longer on every rank (each touches
  VISIONDIST_SLOW_MARK.<pid>);
- `slow_export`: an export takes VISIONDIST_SLOW_S seconds longer (touching
  VISIONDIST_SLOW_MARK.<pid>);
- `predict_kill:n`: tools/predict.py: once rank 0 has written its n-th batch, the whole job is
  SIGKILLed.
"""

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KIND, _, ARG = os.environ.get("VISIONDIST_FAULT", "").partition(":")
N = int(ARG or 0)


def _in_worker() -> bool:
    import torch.utils.data

    return torch.utils.data.get_worker_info() is not None


def _patch_getitem() -> None:
    from visiondist.data.imagefolder import ImageFolder

    original, served = ImageFolder.__getitem__, [0]

    def getitem(self, key):
        if self._bad.train and _in_worker():
            served[0] += 1
            if served[0] > N:
                if KIND == "getitem_raise":
                    raise ValueError(f"injected failure reading sample {key}")
                if KIND == "getitem_hang":
                    time.sleep(10_000)
                if KIND == "worker_kill":
                    os.kill(os.getpid(), signal.SIGKILL)
        return original(self, key)

    ImageFolder.__getitem__ = getitem


def _patch_eval() -> None:
    from visiondist.engine import tasks

    def evaluate(self, *args, **kwargs):
        raise RuntimeError("injected failure during evaluation")

    tasks.ClassificationTask.evaluate = evaluate


def _patch_save() -> None:
    from visiondist.checkpoint import dcp as checkpoint

    original, calls = checkpoint.dcp.save, [0]

    def save(state, *args, checkpoint_id=None, **kwargs):
        calls[0] += 1
        if calls[0] == N:
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(28, "injected write error: No space left on device")
        return original(state, *args, checkpoint_id=checkpoint_id, **kwargs)

    checkpoint.dcp.save = save


def _patch_rank_hang() -> None:
    import torch.distributed as dist

    from visiondist.engine.step import OptimizerStep

    original = OptimizerStep.train_step

    def train_step(self, batches):
        if dist.get_rank() == 1 and self.state.step + 1 == N:
            time.sleep(10_000)
        return original(self, batches)

    OptimizerStep.train_step = train_step


def _patch_rank_kill() -> None:
    import torch.distributed as dist

    from visiondist.engine.step import OptimizerStep

    original = OptimizerStep.train_step

    def train_step(self, batches):
        if dist.get_rank() == 1 and self.state.step + 1 == N:
            mark = os.environ.get("VISIONDIST_SLOW_MARK")
            if mark:
                Path(f"{mark}.{os.getpid()}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, batches)

    OptimizerStep.train_step = train_step


def _patch_cuda_oom() -> None:
    import torch
    import torch.distributed as dist

    from visiondist.engine.step import OptimizerStep

    original = OptimizerStep.train_step

    from visiondist.utils.heartbeat import PROGRESS

    def train_step(self, batches):
        # what the allocator raises, word for word (torch 2.11)
        if dist.get_rank() == 1 and self.state.step + 1 == N:
            PROGRESS.at("training", self.state.step + 1)
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
                "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
                "has 78.12 GiB memory in use. Of the allocated memory 75.31 GiB is allocated by "
                "PyTorch, and 1.33 GiB is reserved by PyTorch but unallocated. If reserved but "
                "unallocated memory is large try setting "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
            )
        return original(self, batches)

    OptimizerStep.train_step = train_step


def _patch_slow_step() -> None:
    from visiondist.engine.step import OptimizerStep

    original, seconds = OptimizerStep.train_step, float(os.environ.get("VISIONDIST_SLOW_S", "40"))

    def train_step(self, batches):
        if self.state.step + 1 == N:
            print(f"step {N} is slow: {seconds:g} s", flush=True)
            time.sleep(seconds)
        return original(self, batches)

    OptimizerStep.train_step = train_step


def _slowly(original):
    seconds = float(os.environ.get("VISIONDIST_SLOW_S", "40"))

    def slow(*args, **kwargs):
        # a file per process that reached the slow part
        mark = os.environ.get("VISIONDIST_SLOW_MARK")
        if mark:
            Path(f"{mark}.{os.getpid()}").touch()
        time.sleep(seconds)
        return original(*args, **kwargs)

    return slow


def _patch_slow_eval() -> None:
    from visiondist.engine import tasks

    tasks.ClassificationTask.evaluate = _slowly(tasks.ClassificationTask.evaluate)


def _patch_slow_export() -> None:
    from visiondist.checkpoint import export

    export.export = _slowly(export.export)


def _patch_predict_kill() -> None:
    import torch.distributed as dist

    from visiondist.inference.outputs import PartWriter

    original, written = PartWriter.write, [0]

    def write(self, records):
        original(self, records)
        written[0] += 1
        if dist.get_rank() == 0 and written[0] == N:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    PartWriter.write = write


PATCHES = {
    "getitem_raise": _patch_getitem,
    "getitem_hang": _patch_getitem,
    "worker_kill": _patch_getitem,
    "eval_raise": _patch_eval,
    "save_fail": _patch_save,
    "rank_hang": _patch_rank_hang,
    "rank_kill": _patch_rank_kill,
    "cuda_oom": _patch_cuda_oom,
    "slow_step": _patch_slow_step,
    "slow_eval": _patch_slow_eval,
    "slow_export": _patch_slow_export,
    "predict_kill": _patch_predict_kill,
}
if KIND:
    PATCHES[KIND]()

if __name__ == "__main__":
    tool_name = os.environ.get("VISIONDIST_TOOL", "train")
    spec = importlib.util.spec_from_file_location(
        f"{tool_name}_tool", REPO / "tools" / f"{tool_name}.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    sys.exit(tool.main(sys.argv[1:]))
