"""Ray Train: `visiondist.ray.train` on a local Ray cluster of 2 CPUs, 2 TorchTrainer workers
joining the process group Ray made, equals the self-launched dp=2 run; the run dir is under Ray's
storage path; a bad override is refused before any worker starts."""

import json
import sys

import pytest
from helpers import TINY_DATA, finish_job, job_env, losses_of, run_cli, start_job

pytest.importorskip("ray")

STEPS = [
    "model.num_heads=2",
    "data.batch_size=16",
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=3",
    "trainer.loggers=[csv]",
]

# the driver: a local Ray cluster of 2 CPUs (no dashboard), then train() once per call given (one
# cluster for all of them: a cluster's start is most of a call's time), each printing `CALL <k>
# SUMMARY <json>` or `CALL <k> FAILED ...`
DRIVER = """
import json, sys
import ray
import visiondist.ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
calls, storage = json.loads(sys.argv[1]), sys.argv[2]
for k, (overrides, name) in enumerate(calls):
    try:
        summary = visiondist.ray.train(overrides, num_workers=2, storage_path=storage, name=name)
    except Exception as exc:
        print(f"CALL {k} FAILED:", type(exc).__name__, exc, flush=True)
        continue
    # what the call left of the run's log (a complete run: untouched)
    log = f"{storage}/{name}/run/train.log"
    print(f"CALL {k} LOG " + open(log).read().replace(chr(10), "|"), flush=True)
    print(f"CALL {k} SUMMARY " + json.dumps(summary, default=str), flush=True)
"""


def _fit(tmp_path, calls):
    """visiondist.ray.train for each (overrides, job name) of `calls`, in order, on one local Ray
    cluster: (exit code, output, storage path, what each call printed: its summary, or None and the
    output for a failure)."""
    storage = tmp_path / "ray"
    proc = start_job(
        [sys.executable, "-c", DRIVER, json.dumps(calls), str(storage)],
        job_env(RAY_DISABLE_USAGE_STATS="1", RAY_USAGE_STATS_ENABLED="0"),
    )
    out = finish_job(proc, 300, "visiondist.ray.train")
    results = []
    for k in range(len(calls)):
        start = out.find(f"CALL {k} SUMMARY ")
        results.append(
            json.loads(out[start:].splitlines()[0].split(" SUMMARY ", 1)[1]) if start >= 0 else None
        )
    return proc.returncode, out, storage, results


def _log_after(out: str, k: int) -> str:
    """The run's train.log as call `k` left it."""
    return out[out.index(f"CALL {k} LOG ") :].splitlines()[0][len(f"CALL {k} LOG ") :]


def test_ray_train_workers_train_like_the_self_launched_run(tmp_path, tiny_shapes):
    overrides = [*TINY_DATA, f"data.root={tiny_shapes}", *STEPS, "parallel.dp=2"]
    reference = tmp_path / "self_launched"
    out = run_cli(
        [*overrides, "trainer.accelerator=cpu", f"trainer.run_dir={reference}"], timeout=300
    )
    assert out.returncode == 0, out.stdout[-4000:]

    # the same call again (here on the same Ray cluster): the run is complete, nothing is rewritten
    code, out, storage, (summary, again) = _fit(tmp_path, [[overrides, "job"], [overrides, "job"]])
    assert code == 0 and summary is not None, out[-5000:]
    run = storage / "job" / "run"
    assert (run / "config.yaml").is_file() and (run / "model.safetensors").is_file()
    assert losses_of(run) == losses_of(reference)  # the same ranks, data and steps: bit for bit
    expected = json.loads((reference / "summary.json").read_text())
    # the summary tools/train.py writes
    for key in ("layout", "steps", "final train loss", "val images"):
        assert summary[key] == expected[key], key
    assert summary["run dir"] == str(run)
    log = (run / "train.log").read_text()
    assert "dp=2 tp=1 pp=1 (2 ranks on cpu)" in log
    assert "is complete at step 6: nothing to do" in out, out[-3000:]
    assert again == summary
    assert len(losses_of(run)) == 6 and _log_after(out, 0) == _log_after(out, 1) == log.replace(
        "\n", "|"
    )


def test_a_bad_override_is_refused_before_any_worker(tmp_path, tiny_shapes):
    bad = [
        ("parallel.tp=3", "parallel.tp=3 does not divide model.num_heads=2"),
        ("parallel.dp=4", "but the world size is 2"),
    ]
    calls = [
        [[*TINY_DATA, f"data.root={tiny_shapes}", override, "model.num_heads=2"], f"job{k}"]
        for k, (override, _) in enumerate(bad)
    ]
    code, out, storage, results = _fit(tmp_path, calls)
    assert code == 0 and results == [None, None], out[-3000:]
    for k, (_, says) in enumerate(bad):
        line = out[out.index(f"CALL {k} FAILED: ConfigError") :].splitlines()[0]
        assert says in line, out[-3000:]
        assert not (storage / f"job{k}").exists()  # no run dir
    assert "RayTrainWorker" not in out  # no worker started
