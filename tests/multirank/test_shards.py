"""Training from packed shards: dp=2 over HTTP equals one process reading the directory, a run
continues on another world size with the uninterrupted run's losses, and two nodes of two ranks each
fetch about half the shards."""

from __future__ import annotations

import json
import socket
import sys

import pytest
from helpers import TRAIN, losses_of, run_cli, run_together, train_args, train_ok
from shard_server import serve

from visiondist.data.shards.pack import PackOptions, pack_image_folder

STEPS = 8


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_shapes):
    """The tiny shapes set in shards of ~8 images (12 train shards), packed once."""
    out = tmp_path_factory.mktemp("packed")
    pack_image_folder(
        tiny_shapes, ["train", "val"], out, PackOptions(shard_mb=0.008, workers=2, progress=False)
    )
    return out


def _args(root, run, *extra):
    return train_args(
        root,
        run,
        "data.format=shards",
        f"trainer.max_steps={STEPS}",
        "trainer.eval_every=4",
        "model.num_heads=2",
        "data.streams=4",
        *extra,
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, packed):
    run = tmp_path_factory.mktemp("one") / "run"
    train_ok(*_args(packed, run))
    return run


def test_dp2_over_http_equals_one_process_on_the_directory(tmp_path, packed, one_process):
    run = tmp_path / "run"
    with serve(packed) as url:
        train_ok(*_args(url, run, "parallel.dp=2", f"data.cache_dir={tmp_path / 'cache'}"))
    a, b = losses_of(one_process), losses_of(run)
    assert list(b) == list(range(1, STEPS + 1))
    assert [b[s] for s in b] == pytest.approx([a[s] for s in a], rel=1e-5)
    fetched = json.loads((run / "summary.json").read_text())["shard MB fetched per rank"]
    assert len(fetched) == 2 and all(f > 0 for f in fetched)


def test_dp2_from_an_s3_endpoint_equals_one_process(tmp_path, packed, one_process, monkeypatch):
    """s3:// URLs against moto's S3-compatible server on the loopback interface (boto3 reads the
    endpoint and the credentials from the environment the ranks inherit)."""
    from shard_server import serve_s3

    run = tmp_path / "run"
    with serve_s3(packed, monkeypatch) as url:
        train_ok(*_args(url, run, "parallel.dp=2", f"data.cache_dir={tmp_path / 'cache'}"))
    a, b = losses_of(one_process), losses_of(run)
    assert [b[s] for s in b] == pytest.approx([a[s] for s in a], rel=1e-5) and len(b) == STEPS


def test_a_shard_run_continues_on_another_world_size(tmp_path, packed, one_process):
    """Stopped after 4 steps on 2 ranks, continued on 1 (and 1 -> 2) over HTTP: the uninterrupted
    run's losses, and after 1 -> 2 each rank fetches its part of the shards, not all of them."""
    # MB
    every = sum(p.stat().st_size for p in packed.iterdir() if p.suffix in (".tar", ".npz")) / 1e6
    for first, then in (("parallel.dp=2", "parallel.dp=1"), ("parallel.dp=1", "parallel.dp=2")):
        run = tmp_path / first.replace("parallel.dp=", "dp")
        train_ok(*_args(packed, run, first, "trainer.stop_at_step=4"))
        with serve(packed) as url:
            # same pack
            train_ok(
                f"trainer.run_dir={run}",
                then,
                f"data.root={url}",
                "trainer.allow_changes=true",
                f"data.cache_dir={run}-cache",
            )
        a, b = losses_of(one_process), losses_of(run)
        assert [b[s] for s in range(5, STEPS + 1)] == pytest.approx(
            [a[s] for s in range(5, STEPS + 1)], rel=1e-5
        )
        fetched = json.loads((run / "summary.json").read_text())["shard MB fetched per rank"]
        assert len(fetched) == int(then[-1]) and all(f > 0 for f in fetched), fetched
        if then == "parallel.dp=2":
            assert all(f < 0.8 * every for f in fetched), (fetched, every)


def test_a_server_killed_mid_epoch_ends_the_job_naming_the_shard_and_the_run_continues(
    tmp_path, packed, one_process
):
    """dp=2 over HTTP with the shipped loader workers; the server dies after serving 13 of the 16
    shards: the job ends within seconds (one retry), its line naming the shard's URL and the cause;
    once the server is back, the continue command finishes with the uninterrupted run's losses."""
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    args = _args(
        f"http://127.0.0.1:{port}",
        run,
        "parallel.dp=2",
        "data.num_workers=2",
        "data.fetch_retries=1",
        "trainer.checkpoint_every=1",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    # of 16 (12 train, 4 val; ~10 prefetched for step 1)
    with serve(packed, port=port, stop_after=13):
        start = time.monotonic()
        result = run_cli(args, timeout=240)
    assert result.returncode != 0 and time.monotonic() - start < 120
    line = [x for x in result.stdout.splitlines() if x.startswith("error:")][-1]
    assert f"cannot fetch http://127.0.0.1:{port}/" in line and "Connection refused" in line, line
    assert "after 2 attempts" in line, line
    assert "once fixed, continue from step" in line and f"trainer.run_dir={run}" in line, line
    with serve(packed, port=port):
        train_ok(f"trainer.run_dir={run}")
    a, b = losses_of(one_process), losses_of(run)
    assert [b[s] for s in range(1, STEPS + 1)] == pytest.approx(
        [a[s] for s in range(1, STEPS + 1)], rel=1e-5
    )


def test_two_nodes_of_two_ranks_each_fetch_about_half_the_shards(tmp_path, packed):
    """Two torchrun agents (c10d rendezvous on loopback), each a "node" with its own cache: with
    data.streams=4 a node's two ranks read two of the four parts of each epoch, so each node fetches
    about half of the train shards (plus its half of the val shards and the indexes), not all of
    them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    train_bytes = (
        sum(s["filesize"] for s in json.loads((packed / "train.json").read_text())["shardlist"])
        / 1e6
    )
    # MB
    every = sum(p.stat().st_size for p in packed.iterdir() if p.suffix in (".tar", ".npz")) / 1e6
    with serve(packed) as url:
        agent = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=shards",
            "--max-restarts=0",
            str(TRAIN),
            *_args(url, tmp_path / "run", "trainer.max_steps=6", "trainer.eval_every=6"),
        ]
        envs = [{"XDG_CACHE_HOME": str(tmp_path / f"node{n}")} for n in range(2)]
        for result in run_together([agent, agent], timeout=300, envs=envs):
            assert result.returncode == 0, result.stdout[-4000:]
    fetched = json.loads((tmp_path / "run" / "summary.json").read_text())[
        "shard MB fetched per rank"
    ]
    nodes = [fetched[0] + fetched[1], fetched[2] + fetched[3]]
    assert all(0.3 * every < n < 0.75 * every for n in nodes), (nodes, every, train_bytes)
    assert sum(nodes) < 1.4 * every  # not every node fetching everything (that would be 2x)


def test_coco_from_shards_trains_evaluates_and_resumes_as_from_the_tree(tmp_path):
    """The built-in COCO-format set, trained from its tree and from its shards: the same losses and
    the same 12 COCOeval numbers; tools/eval.py on the shard run reproduces them; a run stopped
    after step 2 and continued ends with the uninterrupted run's loss."""
    from helpers import REPO
    from test_detection_train import DETECT

    from visiondist.data.shards.packed_coco import pack_coco
    from visiondist.observe.metrics import read_metrics

    def evals_of(run, *columns):
        return {
            r["step"]: tuple(r[c] for c in columns)
            for r in read_metrics(run / "metrics.csv")
            if r.get("val_mAP") is not None
        }

    data, packed = tmp_path / "shapes_coco", tmp_path / "packed"
    common = [*DETECT, "trainer.max_steps=4", "trainer.eval_every=4"]
    tree = tmp_path / "tree"
    train_ok(*common, f"data.root={data}", f"trainer.run_dir={tree}")
    pack_coco(
        {s: (data / s, data / "annotations" / f"instances_{s}.json") for s in ("train", "val")},
        packed,
        PackOptions(shard_mb=0.01, workers=2, progress=False),
        data,
    )
    shards = [*common, "data.format=shards", f"data.root={packed}"]
    run = tmp_path / "shards"
    train_ok(*shards, f"trainer.run_dir={run}")
    assert losses_of(run) == losses_of(tree)
    columns = (
        "val_mAP",
        "val_AP50",
        "val_AP75",
        "val_APs",
        "val_APm",
        "val_APl",
        "val_AR1",
        "val_AR10",
        "val_AR100",
        "val_ARs",
        "val_ARm",
        "val_ARl",
    )
    assert evals_of(run, *columns) == evals_of(tree, *columns) and len(evals_of(run, *columns)) == 1
    evaluated = run_cli([f"run_dir={run}"], timeout=300, script=REPO / "tools" / "eval.py")
    assert evaluated.returncode == 0 and evaluated.stdout.count("Average ") == 12, evaluated.stdout[
        -3000:
    ]
    assert (
        json.loads(next((run / "eval").iterdir()).joinpath("eval.json").read_text())["val_mAP"]
        == evals_of(run, "val_mAP")[4][0]
    )
    split = tmp_path / "split"
    train_ok(*shards, f"trainer.run_dir={split}", "trainer.stop_at_step=2")
    # the same world size: a detector's loss is a mean per rank's images
    train_ok(f"trainer.run_dir={split}")
    assert losses_of(split)[4] == pytest.approx(losses_of(run)[4], rel=1e-5)


def test_a_run_from_the_cache_with_the_server_down_says_so_in_one_line(
    tmp_path, packed, one_process
):
    """Every shard in the node's cache and the server gone: the run trains from the cache, says so
    in one line, and prints no retry warnings (it printed 40 before step 1: each process retried
    each small file)."""
    cache = tmp_path / "cache"
    with serve(packed) as url:
        train_ok(*_args(url, tmp_path / "first", "parallel.dp=2", f"data.cache_dir={cache}"))
    out = train_ok(*_args(url, tmp_path / "offline", "parallel.dp=2", f"data.cache_dir={cache}"))
    assert (
        out.count(f"{url} cannot be reached") == 1 and "reading this node's cached copy" in out
    ), out[-3000:]
    assert "attempt" not in out and "fetching" not in out, out[-3000:]
    b = losses_of(tmp_path / "offline")
    assert [b[s] for s in b] == pytest.approx(
        [losses_of(one_process)[s] for s in b], rel=1e-5
    ) and len(b) == STEPS
