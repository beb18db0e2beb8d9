"""Test helpers: run the real CLI in its own process group with a hard timeout that kills every
child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "tools" / "train.py"

# A tiny shapes set and a 2-block ViT: the whole pipeline in seconds on two cores.
TINY_DATA = [
    "data.synthetic.train_per_class=16",
    "data.synthetic.val_per_class=5",
    "data.synthetic.image_size=32",
    "data.img_size=32",
    # per-sample seeded augmentation: workers change no compared number, only the load on 2
    "data.num_workers=0",
    # cores; the fault tests run the shipped 2 workers (tests/multirank/test_failures.py,
    # WORKERS_ON)
    "model.depth=2",
    "trainer.progress=false",
    # about half a second of CPU a run; the tests of the PNGs draw them (assert_png)
    "trainer.plots=false",
]


def job_env(**extra: str) -> dict:
    """The environment of a job a test starts: one thread per process, unbuffered output, plus
    `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def start_job(
    command: list[str], env: Optional[dict] = None, cwd: Path = REPO, fresh: bool = False
):
    """`command` in its own session (so that a timeout can kill every process it starts), output and
    errors in one text pipe. A `python <script> ...` or `python -m <module> ...` is forked from this
    test process's prepared interpreter (`PreparedRun`: the same process tree, signals and exit
    codes, without the 5 s of imports), unless `fresh` or VISIONDIST_TEST_FRESH=1 asks for a new
    interpreter, or `env` differs where start-up reads it."""
    from prepared import PreparedRun, prepared_for

    env = env or job_env()
    if not fresh and command[0] == sys.executable and prepared_for(command[1:], env, job_env()):
        return PreparedRun(command[1:], env, cwd)
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish_job(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The output of a `start_job` process once it ends; past `timeout`, end its whole session and
    fail: SIGABRT first, on which each of its Python processes prints where its threads were
    (PYTHONFAULTHANDLER, tests/conftest.py), then SIGKILL."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        else:  # the processes that outlived their session's leader
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise AssertionError(f"{what} did not finish in {timeout}s:\n{out[-12000:]}") from None
    return out


def run_cli(
    args: list[str], timeout: float = 240, launcher: tuple[str, ...] = (), script: Path = TRAIN
) -> subprocess.CompletedProcess:
    """Run `python [launcher] <script> *args` (default tools/train.py; launcher: e.g. torchrun's
    module and flags); on timeout kill the whole process group, spawned ranks included, and fail."""
    proc = start_job([sys.executable, *launcher, str(script), *args])
    out = finish_job(proc, timeout, f"{script.name} {' '.join(args)}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def run_together(
    commands: list[list[str]],
    timeout: float = 300,
    envs: Optional[list[dict]] = None,
    cwd: Path = REPO,
) -> list[subprocess.CompletedProcess]:
    """Start every command at once (e.g. two torchrun agents of one job), each in its own process
    group; wait for all. On timeout kill every one of them and fail with their output."""
    import time

    procs = [
        start_job(cmd, job_env(**extra), cwd)
        for cmd, extra in zip(commands, envs or [{}] * len(commands))
    ]
    deadline, results = time.monotonic() + timeout, []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    except subprocess.TimeoutExpired:
        texts = []
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            texts.append((proc.communicate()[0] or "")[-3000:])
        raise AssertionError(f"not finished in {timeout}s:\n" + "\n----\n".join(texts)) from None
    return results


def train_args(data_root: Path, run: Path, *extra: str) -> list[str]:
    """The tiny set at 16 images per step, a loss row every step, on the CPU (or the test device:
    `devices.on_test_device`), into `run`."""
    from devices import on_test_device

    return on_test_device(
        [
            *TINY_DATA,
            f"data.root={data_root}",
            "data.batch_size=16",
            "trainer.log_every=1",
            "trainer.accelerator=cpu",
            "trainer.loggers=[csv]",
            f"trainer.run_dir={run}",
            *extra,
        ]
    )


def train_ok(*args: str, timeout: float = 300, script: Path = TRAIN) -> str:
    """Run the CLI, require success, return its output."""
    result = run_cli(list(args), timeout=timeout, script=script)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def evals_of(run: Path, *columns: str) -> dict[int, tuple]:
    """step -> the given evaluation columns (e.g. val_loss, val_top1) from a run's metrics.csv."""
    from visiondist.observe.metrics import read_metrics

    return {
        int(r["step"]): tuple(r[c] for c in columns)
        for r in read_metrics(run / "metrics.csv")
        if r.get("val_loss") is not None
    }


def assert_same_weights(a: Path, b: Path) -> None:
    """Two runs' model.safetensors hold the same tensors to 1e-5 relative."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        # its gradient is round-off only (attention ignores a key bias)
        if not key.endswith("attn.k.bias"):
            torch.testing.assert_close(
                wa[key], wb[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
            )


# Two layouts of one training sum in other orders: fp32 round-off that AdamW, dividing each gradient
# element by its own running magnitude, turns into weight differences of up to 3.3e-5 of a tensor's
# norm (measured: tp4 + SP, tests/multirank/test_tensor_parallel.py), where a wrong gradient moves
# weights by whole steps (lr, over 1e-2 of a tensor's norm). The same round-off can flip the argmax
# of a val image whose top two logits are that close.
LAYOUT_PARAM_TOL = 1e-4
TINY_VAL_IMAGES = 6 * 5  # TINY_DATA's val split: 6 shape classes x data.synthetic.val_per_class


def assert_same_top1(a: float, b: float, images: int = TINY_VAL_IMAGES) -> None:
    """Two top-1 accuracies (percent) of one training under two layouts or input paths: equal, or
    one image apart (a near-tied image's argmax, decided by round-off); the val loss beside it is
    the exact check."""
    assert abs(a - b) <= 100.0 / images + 1e-9, (a, b)


def assert_close_weights(a: Path, b: Path) -> None:
    """Two layouts' model.safetensors hold the same tensors within LAYOUT_PARAM_TOL of each tensor's
    norm."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        # its gradient is round-off only (attention ignores a key bias)
        if not key.endswith("attn.k.bias"):
            error = (
                (wa[key].double() - wb[key].double()).norm()
                / wb[key].double().norm().clamp_min(1e-12)
            ).item()
            assert error <= LAYOUT_PARAM_TOL, (key, error)


def assert_same_training(ref: Path, run: Path, ema: bool = False) -> None:
    """`run` trained as `ref` did under another layout (the 4-step, evaluate-every-2 runs of the
    layout tests): the loss of steps 1-4 within fp32 round-off (1e-5 relative), the evaluations at
    steps 2 and 4 (val loss within round-off, top-1 to one image: `assert_same_top1`; with `ema`,
    the EMA's val loss too) and the final weights (`assert_close_weights`)."""
    import pytest

    ref_losses, losses = losses_of(ref), losses_of(run)
    assert sorted(losses) == [1, 2, 3, 4]
    assert [losses[s] for s in losses] == pytest.approx([ref_losses[s] for s in losses], rel=1e-5)
    columns = ("val_loss", "val_top1", *(("val_ema_loss",) if ema else ()))
    ref_evals, evals = evals_of(ref, *columns), evals_of(run, *columns)
    assert sorted(evals) == [2, 4]
    for step in evals:
        assert evals[step][0] == pytest.approx(ref_evals[step][0], rel=1e-5)  # the model
        assert_same_top1(evals[step][1], ref_evals[step][1])
        if ema:
            assert evals[step][2] == pytest.approx(ref_evals[step][2], rel=1e-5)  # its EMA
    assert_close_weights(ref, run)


def bf16_box_distances(model, device: str):
    """(boxes, distance of each to its nearest fp32 anchor) of a torchvision-style detector under
    bf16 autocast on an 800 x 1333 image, with its box regressions zeroed: every returned box is
    then one of its (clipped) anchors, so any distance is the box arithmetic's alone, not the bf16
    backbone's."""
    import torch
    from torchvision.ops import boxes as box_ops

    model = model.to(device).eval()
    for layer in (model.rpn.head.bbox_pred, model.roi_heads.box_predictor.bbox_pred):
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    image = torch.rand(3, 800, 1333, device=device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        boxes = model([image])[0]["boxes"]
    with torch.no_grad():
        images, _ = model.transform([image])
        features = list(model.backbone(images.tensors).values())
        anchors = box_ops.clip_boxes_to_image(
            model.rpn.anchor_generator(images, features)[0], (800, 1333)
        )
    assert anchors.dtype == torch.float32
    return boxes, (boxes[:, None, :] - anchors[None]).abs().amax(dim=-1).amin(dim=-1)


def losses_of(run: Path) -> dict[int, float]:
    """step -> training loss from a run's metrics.csv."""
    from visiondist.observe.metrics import read_metrics

    return {
        int(r["step"]): r["loss"]
        for r in read_metrics(run / "metrics.csv")
        if r["loss"] is not None
    }


class RanksFailed(AssertionError):
    """Some ranks of `spawn_ranks` failed; `failures` maps each failing global rank to its error and
    traceback."""

    def __init__(self, failures: dict[int, str], text: str):
        super().__init__(text)
        self.failures = failures


def spawn_ranks(fn, nprocs: int, *args, timeout: float = 240, **kwargs):
    """Run `fn(*args, **kwargs)` (a module-level function of a tests/ module) on `nprocs` ranks
    (gloo processes, or on the test device: `devices.init_test_rank`) under torch's elastic
    launcher. Returns {rank: return value}. A failing rank raises `RanksFailed` naming every failing
    rank with its traceback; past `timeout` seconds every process of the group is killed and the
    test fails with their output."""
    import pickle
    import tempfile

    from devices import spawned

    spawned(nprocs)  # the test device has room for them (or the test is skipped)
    with tempfile.TemporaryDirectory() as tmp:
        args_file, result_file = Path(tmp) / "args.pkl", Path(tmp) / "result.pkl"
        args_file.write_bytes(pickle.dumps((args, kwargs)))
        result = run_cli(
            [fn.__module__, fn.__name__, str(nprocs), str(args_file), str(result_file)],
            timeout=timeout,
            script=REPO / "tests" / "multirank" / "run_ranks.py",
        )
        if not result_file.is_file():
            raise AssertionError(
                f"{fn.__name__} on {nprocs} ranks ended without a result "
                f"(exit code {result.returncode}):\n{result.stdout[-4000:]}"
            )
        outcome = pickle.loads(result_file.read_bytes())
    if "failures" in outcome:
        raise RanksFailed(outcome["failures"], outcome["text"])
    return outcome["ok"]


def random_imagefolder(
    root: Path, classes: int, train_per_class: int = 1, val_per_class: int = 1
) -> Path:
    """An ImageFolder tree of random 24 x 24 JPEGs under `root` (train/ and val/, `class00`...),
    seeded."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class{c:02d}"
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(
                    folder / f"{i}.jpg"
                )
    return root


def assert_png(
    path: Path, min_width: int = 400, min_height: int = 250, min_bytes: int = 8000
) -> None:
    """A real plot: a PNG that decodes, of a useful size, and not one flat colour."""
    import numpy as np
    from PIL import Image

    assert path.is_file() and path.stat().st_size >= min_bytes, (
        f"{path}: missing or under {min_bytes} bytes"
    )
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.verify()
    with Image.open(path) as im:
        assert im.width >= min_width and im.height >= min_height, (path, im.size)
        pixels = np.asarray(im.convert("L"), dtype=np.float64)
    assert pixels.std() > 5 and len(np.unique(pixels)) > 20, f"{path} is nearly blank"


def hf_cache_with(cache: Path, name: str, state: dict, filename: str = "model.safetensors") -> Path:
    """A Hugging Face hub cache under `cache` holding `state` as `filename` of repo `timm/<name>`,
    in the layout huggingface_hub writes (refs/main naming a snapshot that holds the file), so that
    its offline resolution finds it exactly as it finds a downloaded file. Returns the file."""
    from safetensors.torch import save_file

    repo = cache / f"models--timm--{name}"
    commit = "5e4f0c1d2b3a49587766554433221100aabbccdd"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(snapshot / filename))
    return snapshot / filename


def torch_hub_cache_with(torch_home: Path, url: str, state: dict) -> Path:
    """torch hub's cache under `torch_home` (TORCH_HOME) holding `state` as the file `url` names,
    where `torch.hub.load_state_dict_from_url` keeps what it downloads."""
    import torch

    file = torch_home / "hub" / "checkpoints" / os.path.basename(url)
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, file)
    return file


def load_tool(name: str):
    """`tools/<name>.py` as a module (the tools are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_tool(capsys, name: str, *argv: str):
    """(exit code, stdout, stderr lines) of `tools/<name>.py argv`, in this process."""
    code = load_tool(name).main(list(argv))
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if line.strip()]


def wait_for(condition, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll `condition` until it holds; if `proc` ends first or `timeout` passes, kill its session
    and fail."""
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None or time.time() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(
                f"never saw {what} (exit code {proc.poll()}):\n{proc.communicate()[0][-4000:]}"
            )
        time.sleep(0.02)


def detr_model_cfg(arch: str, **kw):
    """A DETR-class model config (`model.family=detr`'s keys) for `arch` at 128 px, 3 classes, 20
    queries."""
    from omegaconf import OmegaConf

    base = {
        "name": arch,
        "arch": arch,
        "num_classes": 3,
        "img_size": 128,
        "kwargs": {},
        "num_queries": 20,
        "weights": None,
        "multi_scale": None,
    }
    return OmegaConf.create({**base, **kw})


# A stand-in for srun: one task per node x tasks per node, each with the variables srun gives its
# tasks; with SRUN_SCRIPT set, that script runs in place of tools/train.py (e.g.
# tests/multirank/fault_train.py).
FAKE_SRUN = """#!{python}
import os, subprocess, sys
script = os.environ.get("SRUN_SCRIPT")
command = [script if script and a.endswith("tools/train.py") else a
           for a in sys.argv[1:] if not a.startswith("--")]
nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
tasks = []
for rank in range(nodes * per_node):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
               SLURM_NODEID=str(rank // per_node), SLURM_STEP_NUM_TASKS=str(nodes * per_node),
               SLURM_STEP_TASKS_PER_NODE=f"{{per_node}}(x{{nodes}})",
               SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"])
    tasks.append(subprocess.Popen(command, env=env))
sys.exit(max(task.wait() for task in tasks))
"""


def fake_slurm(bin_dir: Path, job_id: str, nodes: int, per_node: int, run_dir: Path) -> dict:
    """Stand-ins for `srun` and `scontrol` in `bin_dir`, and the environment under which `bash
    tools/slurm_train.sh` runs as sbatch would run it (`nodes` x `per_node` tasks on this machine,
    the script's run dir `run_dir`)."""
    import socket

    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    # a long node list, as a large job's: the script must read it whole (a reader that stops at the
    # first name leaves scontrol writing into a closed pipe)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\nseq 1 200000\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NODELIST": f"node[1-{nodes}]" if nodes > 1 else "node1",
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "MASTER_PORT": str(port),
        "RUN_DIR": str(run_dir),
    }


def assert_same_detections(
    ours: dict, theirs: dict, box_atol: float, score_atol: float
) -> list[tuple[int, int]]:
    """Two detectors' outputs (boxes, labels, scores) as sets, order aside: each detection on either
    side has a counterpart of its label on the other with its box within `box_atol` and its score
    within `score_atol`. A barely trained detector's scores tie to within float round-off, and which
    of them comes first (or makes the last place of the top k, or survives NMS beside a near twin)
    depends on the CPU's rounding and the library's sort: the detections within `score_atol` of the
    lowest kept score may have no counterpart and are left out. Returns the pairs (index in `ours`,
    index in `theirs`) matched, for comparing what else each detection holds (masks)."""
    import torch

    ours, theirs = (
        {k: torch.as_tensor(d[k]) for k in ("boxes", "labels", "scores")} for d in (ours, theirs)
    )
    assert len(ours["scores"]) and len(theirs["scores"]), (
        len(ours["scores"]),
        len(theirs["scores"]),
    )
    cut = max(ours["scores"].min(), theirs["scores"].min()) + 2 * score_atol
    pairs = []
    for forward, (a, b) in ((True, (ours, theirs)), (False, (theirs, ours))):
        for i, (box, label, score) in enumerate(zip(a["boxes"], a["labels"], a["scores"])):
            if score <= cut:
                continue
            near = (
                (b["labels"] == label)
                & ((b["boxes"] - box).abs().amax(-1) <= box_atol)
                & ((b["scores"] - score).abs() <= score_atol)
            )
            assert near.any(), (label, box, score)
            if forward:
                j = int(torch.where(near, (b["boxes"] - box).abs().amax(-1), float("inf")).argmin())
                pairs.append((i, j))
    return pairs


def tiny_vitdet(tmp_path: Path, masks: bool):
    """A one-block ViTDet of 64 px (with a mask head where `masks`), fresh, as the export takes it
    (`Trained`); every box kept (score threshold 0)."""
    import torch

    from visiondist.checkpoint.export.trained import Trained
    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.detection import drop_fp32_hooks

    cfg = load_config(
        REPO / "configs",
        [
            "model=vitdet_tiny",
            "data=shapes_coco",
            f"data.root={tmp_path / 'absent'}",
            "data.img_size=64",
            "data.min_size=64",
            "data.max_size=64",
            "model.depth=1",
            "model.embed_dim=32",
            "model.num_heads=2",
            "model.fpn_channels=16",
            f"model.masks={str(masks).lower()}",
            "+model.kwargs.box_score_thresh=0.0",
        ],
        inputs=None,
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    drop_fp32_hooks(model)
    return Trained(
        cfg, model, tmp_path / "step_1", 1, [f"c{i}" for i in range(cfg.model.num_classes)]
    )


def sample_photos(*names: str) -> list:
    """scikit-image's photographs by name (`skimage.data.<name>()`), as float CHW tensors in
    [0, 1]: real images of different sizes, shipped with the package (no download)."""
    import torch
    from skimage import data

    return [
        torch.from_numpy(getattr(data, name)()).permute(2, 0, 1).float() / 255 for name in names
    ]
