"""Ray Train: `visiondist.ray.fit` on a local Ray cluster of 2 CPUs, 2 TorchTrainer workers joining the process group
Ray made, equals the self-launched dp=2 run; the run dir is under Ray's storage path; a bad override is refused
before any worker starts."""

import json
import sys

import pytest

from helpers import TINY_DATA, job_env, losses_of, run_cli, start_job, finish_job

pytest.importorskip("ray")

STEPS = ["model.num_heads=2", "data.batch_size=16", "trainer.max_steps=6", "trainer.log_every=1",
         "trainer.eval_every=3", "trainer.loggers=[csv]"]

# the driver: a local Ray cluster of 2 CPUs (no dashboard), then fit(); prints the summary as one JSON line
DRIVER = """
import json, sys
import ray
import visiondist.ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
overrides, storage = json.loads(sys.argv[1]), sys.argv[2]
try:
    summary = visiondist.ray.fit(overrides, num_workers=2, storage_path=storage, name="job")
except Exception as exc:
    print("FIT FAILED:", type(exc).__name__, exc)
    sys.exit(3)
print("SUMMARY " + json.dumps(summary, default=str))
"""


def _fit(tmp_path, overrides):
    storage = tmp_path / "ray"
    proc = start_job([sys.executable, "-c", DRIVER, json.dumps(overrides), str(storage)],
                     job_env(RAY_DISABLE_USAGE_STATS="1", RAY_USAGE_STATS_ENABLED="0"))
    out = finish_job(proc, 300, "visiondist.ray.fit")
    return proc.returncode, out, storage


def test_ray_train_workers_train_like_the_self_launched_run(tmp_path, tiny_shapes):
    overrides = [*TINY_DATA, f"data.root={tiny_shapes}", *STEPS, "parallel.dp=2"]
    reference = tmp_path / "self_launched"
    out = run_cli([*overrides, "trainer.accelerator=cpu", f"trainer.run_dir={reference}"], timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]

    code, out, storage = _fit(tmp_path, overrides)
    assert code == 0, out[-5000:]
    summary = json.loads(out.split("SUMMARY ", 1)[1].splitlines()[0])
    run = storage / "job" / "run"
    assert (run / "config.yaml").is_file() and (run / "model.safetensors").is_file()
    assert losses_of(run) == losses_of(reference)  # the same ranks, data and steps: bit for bit
    expected = json.loads((reference / "summary.json").read_text())
    for key in ("layout", "steps", "final train loss", "val images"):  # the summary tools/train.py writes
        assert summary[key] == expected[key], key
    assert summary["run dir"] == str(run)
    log = (run / "train.log").read_text()
    assert "dp=2 tp=1 pp=1 (2 ranks on cpu)" in log

    code, out, _ = _fit(tmp_path, overrides)  # the same call again: the run is complete, nothing is rewritten
    assert code == 0 and "is complete at step 6: nothing to do" in out, out[-3000:]
    assert json.loads(out.split("SUMMARY ", 1)[1].splitlines()[0]) == summary
    assert len(losses_of(run)) == 6 and (run / "train.log").read_text() == log


@pytest.mark.parametrize("bad,says", [("parallel.tp=3", "parallel.tp=3 does not divide model.num_heads=2"),
                                       ("parallel.dp=4", "but the world size is 2")])
def test_a_bad_override_is_refused_before_any_worker(tmp_path, tiny_shapes, bad, says):
    code, out, storage = _fit(tmp_path, [*TINY_DATA, f"data.root={tiny_shapes}", bad, "model.num_heads=2"])
    assert code == 3 and "FIT FAILED: ConfigError" in out and says in out, out[-3000:]
    assert not (storage / "job").exists() and "RayTrainWorker" not in out  # no worker started
