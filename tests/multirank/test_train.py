"""End to end through `python tools/train.py`: self-launched ranks, one run dir, dp=2 and dp=2 x
tp=2 (+SP) equal to dp=1. The tests marked `layouts` also run with the ranks on a GPU
(tests/devices.py)."""

import json
import socket
import sys

import pytest
import yaml
from devices import on_test_device, ranks_on
from helpers import (
    REPO,
    TINY_DATA,
    TRAIN,
    assert_png,
    assert_same_top1,
    evals_of,
    fake_slurm,
    losses_of,
    run_cli,
    run_together,
)

from visiondist.observe.metrics import read_metrics

STEPS = 6


def _args(out, tiny_shapes, *extra):
    return on_test_device(
        [
            *TINY_DATA,
            "model.num_heads=2",
            f"data.root={tiny_shapes}",
            "data.batch_size=16",
            f"trainer.max_steps={STEPS}",
            "trainer.log_every=1",
            "trainer.eval_every=3",
            "trainer.accelerator=cpu",
            f"trainer.output_dir={out}",
            *extra,
        ]
    )


def _train(tmp_path, tiny_shapes, name, *extra):
    out = tmp_path / name
    result = run_cli(_args(out, tiny_shapes, *extra), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return _one_run(out), result.stdout


def _one_run(out):
    runs = [p.parent for p in out.rglob("config.yaml")]
    assert len(runs) == 1, runs  # one run dir for the whole job, not one per rank
    return runs[0]


@pytest.fixture(scope="module")
def dp1_run(tmp_path_factory, tiny_shapes):
    return _train(tmp_path_factory.mktemp("ref"), tiny_shapes, "dp1", "trainer.plots=true")[0]


def _same_training(run1, run2):
    m1, m2 = read_metrics(run1 / "metrics.csv"), read_metrics(run2 / "metrics.csv")
    train1 = [r for r in m1 if r["loss"] is not None]
    train2 = [r for r in m2 if r["loss"] is not None]
    assert [r["step"] for r in train2] == list(range(1, STEPS + 1))
    for a, b in zip(train1, train2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6), (a, b)
    assert len({r["loss"] for r in train1}) > 1  # it trained: the losses move
    eval1 = [r for r in m1 if r["val_top1"] is not None]
    eval2 = [r for r in m2 if r["val_top1"] is not None]
    assert [r["step"] for r in eval2] == [3, 6]
    for a, b in zip(eval1, eval2, strict=True):
        assert_same_top1(a["val_top1"], b["val_top1"])  # top-5: above 10 classes
        assert (a.get("val_top5") is None) == (b.get("val_top5") is None)
        # computed from the updated weights
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)


DP2_TP2 = ("parallel=dp2_tp2", "parallel.sequence_parallel=true")


@pytest.fixture(scope="module")
def dp2_tp2_run(tmp_path_factory, tiny_shapes):
    """dp2 x tp2 (+SP) on 4 self-launched ranks of this one machine."""
    return _train(tmp_path_factory.mktemp("dp2tp2"), tiny_shapes, "dp2tp2", *DP2_TP2)


@pytest.mark.layouts
def test_dp2_tp2_with_sequence_parallel_equals_dp1(dp2_tp2_run, dp1_run):
    run, stdout = dp2_tp2_run
    assert f"dp=2 tp=2 pp=1 ({ranks_on(4)}) +SP" in stdout
    _same_training(dp1_run, run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val images"] == 30 and summary["TP traffic per step (MB)"] > 0
    # the worst class by name, as per_class.json scores it
    scored = {k: v["top1"] for k, v in json.loads((run / "per_class.json").read_text()).items()}
    worst = min((a, name) for name, a in scored.items() if a is not None)
    assert (summary["val top-1, worst class (%)"], summary["worst class"]) == (
        round(worst[0], 2),
        worst[1],
    )
    assert summary["parameters per rank (M)"] < summary["parameters (M)"]
    # trainer.plots=false / true
    assert not list(run.glob("*.png")) and (dp1_run / "curves.png").is_file()
    log = (run / "train.log").read_text()
    assert (
        "mesh (pp, dp, tp) over 1 node: dp groups [0, 2] [1, 3]: each inside one node; tp groups "
        "[0, 1] [2, 3]" in log
    )


def test_two_torchrun_agents_train_like_one_node(tmp_path, tiny_shapes, dp2_tp2_run):
    """Two torchrun agents on this machine (c10d rendezvous on loopback), 2 "nodes" x 2 ranks, dp2 x
    tp2: the losses and evaluations of the single-node 4-rank run, in one run dir, with each TP
    group inside a node and the DP groups across the two."""
    out = tmp_path / "two_nodes"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-agents",
        "--max-restarts=0",
        str(TRAIN),
        *_args(out, tiny_shapes, *DP2_TP2),
    ]
    for result in run_together([agent, agent], timeout=300):
        assert result.returncode == 0, result.stdout[-4000:]
    run = _one_run(out)
    single = dp2_tp2_run[0]
    # the same ranks in the same mesh: the same numbers, bit for bit
    assert losses_of(run) == losses_of(single)
    assert evals_of(run, "val_loss", "val_top1") == evals_of(single, "val_loss", "val_top1")
    log = (run / "train.log").read_text()
    assert "dp=2 tp=2 pp=1 (4 ranks on cpu) +SP" in log
    assert (
        "mesh (pp, dp, tp) over 2 nodes: dp groups [0, 2] [1, 3]: across 2 nodes; "
        "tp groups [0, 1] [2, 3]: each inside one node" in log
    )


def _pod_envs(contract: str, port: int) -> list[dict]:
    """What each Kubernetes operator sets in the two pods of a 2-pod job
    (visiondist/launch/pods.py), the address being this machine's loopback."""
    if contract == "trainjob":  # Kubeflow Trainer v2 (and PyTorchJob from Training Operator 1.7)
        return [
            {
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "2",
                "PET_NODE_RANK": str(pod),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port),
            }
            for pod in (0, 1)
        ]
    # WORLD_SIZE = the pods (the Training Operator before 1.7, PAI-DLC)
    if contract == "pytorchjob-pods":
        return [
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "RANK": str(pod),
            }
            for pod in (0, 1)
        ]
    return [
        {
            "PET_NNODES": "1:2",
            "PET_NPROC_PER_NODE": "2",
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ID": "pods",
            # an elasticPolicy
            "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
            "PET_MAX_RESTARTS": "0",
        }
    ] * 2


@pytest.mark.parametrize("contract", ["trainjob", "pytorchjob-pods", "pytorchjob-elastic"])
def test_kubernetes_pods_started_as_python_train_like_one_node(
    tmp_path, tiny_shapes, dp2_tp2_run, contract
):
    """Two "pods" on this machine, each `python tools/train.py` with the environment its operator
    gives it, 2 ranks each, dp2 x tp2: the single-node 4-rank run's losses and evaluations, in one
    run dir, each TP group inside a pod. (The pods' count of ranks is the contract's, or for
    WORLD_SIZE-as-pods dp x tp over the pods.)"""
    out = tmp_path / "pods"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pod = [sys.executable, str(TRAIN), *_args(out, tiny_shapes, *DP2_TP2)]
    results = run_together([pod, pod], timeout=300, envs=_pod_envs(contract, port))
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    assert (
        "this pod is" in results[0].stdout
        and "it starts its node's ranks (2 per pod)" in results[0].stdout
    )
    run = _one_run(out)
    single = dp2_tp2_run[0]
    assert losses_of(run) == losses_of(single)
    assert evals_of(run, "val_loss", "val_top1") == evals_of(single, "val_loss", "val_top1")
    log = (run / "train.log").read_text()
    assert "tp groups [0, 1] [2, 3]: each inside one node" in log and "over 2 nodes" in log


def test_srun_tasks_read_their_ranks_from_slurm(tmp_path, tiny_shapes, dp1_run):
    """tools/slurm_train.sh under a stand-in `srun` that starts one task per rank with SLURM's
    variables (2 nodes x 1 task): the tasks form one dp=2 job, equal to dp=1, in the script's run
    dir."""
    run = tmp_path / "slurm_run"
    env = fake_slurm(tmp_path / "bin", "4242", nodes=2, per_node=1, run_dir=run)
    args = [
        a
        for a in _args(tmp_path / "unused", tiny_shapes, "parallel.dp=2")
        if not a.startswith("trainer.output")
    ]
    (result,) = run_together(
        [["bash", str(REPO / "tools" / "slurm_train.sh"), *args]], timeout=300, envs=[env]
    )
    assert result.returncode == 0, result.stdout[-4000:]
    _same_training(dp1_run, run)
    log = (run / "train.log").read_text()
    assert "dp=2 tp=1 pp=1 (2 ranks on cpu)" in log and "dp groups [0, 1]: across 2 nodes" in log


@pytest.mark.layouts
def test_dp2_equals_dp1_and_writes_one_run_dir(tmp_path, tiny_shapes, dp1_run):
    run1 = dp1_run
    run2, stdout = _train(tmp_path, tiny_shapes, "dp2", "parallel.dp=2", "trainer.plots=true")
    assert f"dp=2 tp=1 pp=1 ({ranks_on(2)})" in stdout

    cfg = yaml.safe_load((run2 / "config.yaml").read_text())
    assert cfg["parallel"]["dp"] == 2 and cfg["data"]["root"] == str(tiny_shapes)
    _same_training(run1, run2)
    s1, s2 = (json.loads((r / "summary.json").read_text()) for r in (run1, run2))
    # every val sample counted once, under 1 and 2 ranks
    assert s1["val images"] == s2["val images"] == 30
    for run in (run1, run2):
        assert list((run / "tensorboard").iterdir())
        assert_png(run / "curves.png", min_width=1200)
        assert_png(run / "per_class_top1.png")
        assert_png(run / "confusion.png")
    summary = json.loads((run2 / "summary.json").read_text())
    best = max(v for (v,) in evals_of(run2, "val_top1").values())
    assert summary["best val top-1 (%)"] == best and evals_of(run2, "val_top1")[
        summary["best at step"]
    ] == (best,)
    assert summary["checkpoint"] == str(run2 / "checkpoints" / f"step_{STEPS}")


def test_slurm_variables_become_torch_distributed_ones():
    from visiondist.launch import first_host, slurm_env

    env = {
        "SLURM_STEP_NUM_TASKS": "16",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
    }
    assert slurm_env(env) == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu03",
        "MASTER_PORT": "23456",
    }
    assert slurm_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1"}).keys() == {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
    }
    assert slurm_env({**env, "RANK": "0"}) == {}  # torchrun (or the user) already set the ranks
    # one task: it launches its own ranks
    assert slurm_env({**env, "SLURM_STEP_NUM_TASKS": "1"}) == {}
    assert [first_host(n) for n in ("gpu[03-04,07],cpu1", "node1,node2", "a-b[1]")] == [
        "gpu03",
        "node1",
        "a-b1",
    ]


def test_the_run_says_at_start_which_limit_ends_it(tmp_path, tiny_shapes):
    """trainer.max_steps=9 with trainer.max_epochs=1 of 6 global batches: 9 steps, into a second
    epoch (max_steps, where given, sets the run's length), and the first lines say so."""
    from helpers import train_args, train_ok

    run = tmp_path / "run"
    out = train_ok(
        *train_args(
            tiny_shapes, run, "model.num_heads=2", "trainer.max_steps=9", "trainer.max_epochs=1"
        )
    )
    assert "| 9 steps (trainer.max_steps=9 ends the run)" in out, out[-3000:]
    assert sorted(losses_of(run)) == list(range(1, 10))
    out = train_ok(
        *train_args(tiny_shapes, tmp_path / "epochs", "model.num_heads=2", "trainer.max_epochs=1")
    )
    assert "| 6 steps (trainer.max_epochs=1 of 6 steps ends the run)" in out, out[-3000:]
    out = train_ok(
        *train_args(tiny_shapes, tmp_path / "short", "model.num_heads=2", "trainer.max_steps=2")
    )
    assert "| 2 steps (trainer.max_steps=2 ends the run)" in out
    # one rank: no line about the collectives' timeout, which would wait on nobody
    assert "parallel=auto chose plain DDP on 1 rank" in out and "collective timeout" not in out


def test_compiled_model_trains_as_eager_and_says_what_compiling_cost(tmp_path, tiny_shapes):
    """trainer.compile=true on the CPU (auto leaves it eager there), under DDP on 2 ranks (the
    layout users run; torch's DDPOptimizer cuts the whole-model graph at the gradient buckets): the
    layout says the whole model is compiled, the first step's line says how long it took, in how
    many graphs and where Inductor's caches are, no graph break is warned about, and the losses are
    eager's."""
    from helpers import finish_job, job_env, start_job

    args = ["model.num_heads=2", "trainer.max_steps=3", "trainer.eval_every=1000", "parallel.dp=2"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    out = run_cli(_args(tmp_path / "unused", tiny_shapes, *args, f"trainer.run_dir={eager}"))
    assert out.returncode == 0 and "+compiled" not in out.stdout, out.stdout[-3000:]
    cache = tmp_path / "inductor"
    proc = start_job(
        [
            sys.executable,
            str(TRAIN),
            *_args(
                tmp_path / "unused",
                tiny_shapes,
                *args,
                "trainer.compile=true",
                f"trainer.run_dir={compiled}",
            ),
        ],
        job_env(TORCHINDUCTOR_CACHE_DIR=str(cache)),
    )
    text = finish_job(proc, 600, "the compiled run")
    assert proc.returncode == 0, text[-3000:]
    assert "+compiled model" in text and "compiled the whole model: the first step took" in text, (
        text[-3000:]
    )
    assert "(1 graph;" in text and str(cache) in text and "graph break" not in text
    a, b = losses_of(eager), losses_of(compiled)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=1e-4)


def test_fp8_trains_near_bf16_and_its_checkpoint_resumes_without_it(tmp_path, tiny_shapes):
    """trainer.fp8=tensorwise end to end (a narrow model: torch's CPU float8 matmul is a slow
    reference path): the log says which layers are float8, the losses stay within 3% of the bf16
    run's, and the checkpoint (the same tensor names) continues under plain bf16."""
    pytest.importorskip("torchao")
    args = [
        "model.embed_dim=64",
        "model.num_heads=2",
        "trainer.max_steps=3",
        "trainer.eval_every=1000",
        # 64 wide: torchao's filter (auto) keeps them bf16
        "trainer.precision=bf16",
        "trainer.fp8_layers=all",
    ]
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    out = run_cli(_args(tmp_path / "unused", tiny_shapes, *args, f"trainer.run_dir={bf16}"))
    assert out.returncode == 0, out.stdout[-3000:]
    out = run_cli(
        _args(
            tmp_path / "unused",
            tiny_shapes,
            *args,
            "trainer.fp8=tensorwise",
            f"trainer.run_dir={fp8}",
        )
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert (
        "fp8 (trainer.fp8=tensorwise): 12 of the blocks' 12 linear layers in float8 (torchao; "
        in out.stdout
    )
    a, b = losses_of(bf16), losses_of(fp8)
    assert sorted(b) == [1, 2, 3] and [b[s] for s in a] == pytest.approx(
        [a[s] for s in a], rel=0.03
    )
    more = [a for a in args if not a.startswith("trainer.max_steps")]
    out = run_cli(
        _args(
            tmp_path / "unused", tiny_shapes, *more, "trainer.max_steps=4", f"trainer.run_dir={fp8}"
        )
    )
    assert out.returncode == 0 and "resumed from" in out.stdout.lower(), out.stdout[-3000:]
    assert sorted(losses_of(fp8)) == [1, 2, 3, 4]
