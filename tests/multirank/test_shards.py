"""Training from packed shards: dp=2 over HTTP equals one process reading the directory, a run continues on another
world size with the uninterrupted run's losses, and two nodes of two ranks each fetch about half the shards."""

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
    pack_image_folder(tiny_shapes, ["train", "val"], out, PackOptions(shard_mb=0.008, workers=2, progress=False))
    return out


def _args(root, run, *extra):
    return train_args(root, run, "data.format=shards", f"trainer.max_steps={STEPS}", "trainer.eval_every=4",
                      "model.num_heads=2", "data.streams=4", *extra)


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
    fetched = json.loads((run / "summary.json").read_text())["shard bytes fetched per rank"]
    assert len(fetched) == 2 and all(f > 0 for f in fetched)


def test_dp2_from_an_s3_endpoint_equals_one_process(tmp_path, packed, one_process, monkeypatch):
    """s3:// URLs against moto's S3-compatible server on the loopback interface (boto3 reads the endpoint and the
    credentials from the environment the ranks inherit)."""
    from shard_server import serve_s3

    run = tmp_path / "run"
    with serve_s3(packed, monkeypatch) as url:
        train_ok(*_args(url, run, "parallel.dp=2", f"data.cache_dir={tmp_path / 'cache'}"))
    a, b = losses_of(one_process), losses_of(run)
    assert [b[s] for s in b] == pytest.approx([a[s] for s in a], rel=1e-5) and len(b) == STEPS


def test_a_shard_run_continues_on_another_world_size(tmp_path, packed, one_process):
    """Stopped after 4 steps on 2 ranks, continued on 1 (and 1 -> 2): the uninterrupted run's losses."""
    for first, then in (("parallel.dp=2", "parallel.dp=1"), ("parallel.dp=1", "parallel.dp=2")):
        run = tmp_path / first.replace("parallel.dp=", "dp")
        train_ok(*_args(packed, run, first, "trainer.stop_at_step=4"))
        train_ok(f"trainer.run_dir={run}", then)
        a, b = losses_of(one_process), losses_of(run)
        assert [b[s] for s in range(5, STEPS + 1)] == pytest.approx([a[s] for s in range(5, STEPS + 1)], rel=1e-5)


def test_a_server_killed_mid_epoch_ends_the_job_naming_the_shard_and_the_run_continues(tmp_path, packed,
                                                                                       one_process):
    """dp=2 over HTTP with the shipped loader workers; the server dies after serving 13 of the 16 shards: the job
    ends within seconds (one retry), its line naming the shard's URL and the cause; once the server is back, the
    continue command finishes with the uninterrupted run's losses."""
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    args = _args(f"http://127.0.0.1:{port}", run, "parallel.dp=2", "data.num_workers=2", "data.fetch_retries=1",
                 "trainer.checkpoint_every=1", f"data.cache_dir={tmp_path / 'cache'}")
    with serve(packed, port=port, stop_after=13):  # of 16 (12 train, 4 val; ~10 prefetched for step 1)
        start = time.monotonic()
        result = run_cli(args, timeout=240)
    assert result.returncode != 0 and time.monotonic() - start < 120
    line = [l for l in result.stdout.splitlines() if l.startswith("error:")][-1]
    assert f"cannot fetch http://127.0.0.1:{port}/" in line and "Connection refused" in line, line
    assert "after 2 attempts" in line, line
    assert f"once fixed, continue from step" in line and f"trainer.run_dir={run}" in line, line
    with serve(packed, port=port):
        train_ok(f"trainer.run_dir={run}")
    a, b = losses_of(one_process), losses_of(run)
    assert [b[s] for s in range(1, STEPS + 1)] == pytest.approx([a[s] for s in range(1, STEPS + 1)], rel=1e-5)


def test_two_nodes_of_two_ranks_each_fetch_about_half_the_shards(tmp_path, packed):
    """Two torchrun agents (c10d rendezvous on loopback), each a "node" with its own cache: with data.streams=4 a
    node's two ranks read two of the four parts of each epoch, so each node fetches about half of the train shards
    (plus its half of the val shards and the indexes), not all of them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    train_bytes = sum(s["filesize"] for s in json.loads((packed / "train.json").read_text())["shardlist"])
    every = sum(p.stat().st_size for p in packed.iterdir() if p.suffix in (".tar", ".npz"))
    with serve(packed) as url:
        agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shards", "--max-restarts=0",
                 str(TRAIN), *_args(url, tmp_path / "run", "trainer.max_steps=6", "trainer.eval_every=6")]
        envs = [{"XDG_CACHE_HOME": str(tmp_path / f"node{n}")} for n in range(2)]
        for result in run_together([agent, agent], timeout=300, envs=envs):
            assert result.returncode == 0, result.stdout[-4000:]
    fetched = json.loads((tmp_path / "run" / "summary.json").read_text())["shard bytes fetched per rank"]
    nodes = [fetched[0] + fetched[1], fetched[2] + fetched[3]]
    assert all(0.3 * every < n < 0.75 * every for n in nodes), (nodes, every, train_bytes)
    assert sum(nodes) < 1.4 * every  # not every node fetching everything (that would be 2x)
