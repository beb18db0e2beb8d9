"""benchmarks/gpu/run.sh end to end without a GPU: every mode, combined, runs with stand-ins for the
commands that need one (`python3`, `nvidia-smi`), and every command line it would give them holds:
each tools/train.py and tools/benchmark.py configuration composes and resolves to a layout on the
GPUs the mode is for, each benchmarks/ script accepts its arguments, and each pytest selection
collects tests that exist. A lent GPU's 15 minutes are not spent on a renamed test, a stale override
or a typo in a mode's branch; the rows' run times are the GPU's to show."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

RUN_SH = REPO / "benchmarks" / "gpu" / "run.sh"
# `all`: tests, bench, mfu, kernels and detr
MODES = "all+short+cudagraphs+profile+layouts+multi+memory+predict+native+levers+levers_s+trt"
GPUS = 2  # what the stand-in says torch.cuda.device_count() is (run.sh multi: 2 GPUs -> tp2)

# `python3` as run.sh calls it: logs its arguments; `-c` answers the device questions; everything
# else (pytest, pip, tools, scripts) only logs: they are checked after the run, in the test's
# process and (pytest) in `COLLECT`
STAND_IN = r"""#!{python}
import json, os, sys

args = sys.argv[1:]
with open(os.environ["RUN_SH_LOG"], "a") as log:
    log.write(json.dumps({{"cwd": os.getcwd(), "args": args}}) + "\n")
if args[:1] == ["-c"]:
    stand_in = "torch 2.11.0 torchvision 0.26.0 | CUDA 13.0 | stand-in"
    print({gpus} if "device_count" in args[1] else stand_in)
"""

# every `python3 -m pytest ...` run.sh gave, collected (--collect-only, one process: no workers, no
# time limit) in one interpreter, one pytest session after another: the commands whose selection
# fails or selects no test, with the code
COLLECT = r"""
import json, sys

import pytest

failed = []
for args in json.loads(sys.argv[1]):
    keep = list(args)
    for flag in ("-n", "--timeout"):
        while flag in keep:
            at = keep.index(flag)
            del keep[at:at + 2]
    code = pytest.main(["--collect-only", "-q", "-n", "0", *keep])
    if code != 0:
        failed.append([args, int(code)])
print("FAILED=" + json.dumps(failed))
"""


def _write_stand_ins(where: Path) -> None:
    where.mkdir()
    (where / "python3").write_text(STAND_IN.format(python=sys.executable, gpus=GPUS))
    (where / "nvidia-smi").write_text("#!/bin/sh\necho 'stand-in GPU, 141 GiB, 0.0'\n")
    for name in ("python3", "nvidia-smi"):
        (where / name).chmod((where / name).stat().st_mode | stat.S_IXUSR)


class _Parsed(Exception):
    pass


def _accepts(script: Path, args: list[str]) -> None:
    """`script` (a benchmarks/ script) parses `args` with its own argparse parser; raises
    SystemExit(2) where not."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        original(self, *a, **k)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path
    raise AssertionError(f"{script.name} ran without parsing its arguments")


def test_every_mode_runs_with_stand_ins_and_every_command_it_gives_holds(tmp_path):
    from omegaconf import OmegaConf

    from visiondist.cli import load_config
    from visiondist.plan import resolve

    bin_dir, out, log = tmp_path / "bin", tmp_path / "out", tmp_path / "calls.jsonl"
    _write_stand_ins(bin_dir)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(out),
        "RUN_SH_LOG": str(log),
    }
    result = subprocess.run(
        ["bash", str(RUN_SH), MODES], cwd=REPO, env=env, capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0 and "parts failed: 0" in result.stdout, (
        result.stdout[-6000:],
        result.stderr[-3000:],
    )
    calls = [json.loads(line)["args"] for line in log.read_text().splitlines()]
    tools = [c for c in calls if c and c[0].startswith("tools/")]
    scripts = [c for c in calls if c and c[0].startswith("benchmarks/")]
    tests = [c for c in calls if c[:2] == ["-m", "pytest"]]
    collected = subprocess.run(
        [sys.executable, "-c", COLLECT, json.dumps([c[2:] for c in tests])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    failed = [line for line in collected.stdout.splitlines() if line.startswith("FAILED=")]
    assert failed and json.loads(failed[-1][len("FAILED=") :]) == [], (
        collected.stdout[-4000:],
        collected.stderr[-2000:],
    )
    # what `all` and the other modes promise: the goal rows, the kernels' rows, the DETR rows, the
    # layouts
    assert {c[0] for c in tools} == {"tools/benchmark.py", "tools/train.py"}, tools
    assert len(tools) >= 15 and len(tests) >= 6, calls
    assert {Path(c[0]).name for c in scripts} >= {
        "photos.py",
        "vit_profile.py",
        "fp8_layers.py",
        "loss_curves.py",
        "data_throughput.py",
        "table.py",
        "traffic.py",
        "memory_model.py",
        "predict.py",
        "native.py",
        "trt_check.py",
    }, scripts
    for call in tools:
        # the smaller of the lent GPUs, an H100's
        overrides = [*call[1:], "parallel.device_memory_gb=80"]
        try:
            cfg = load_config(REPO / "configs", overrides, inputs=None)
            # read from the photo tree's class folders at run time
            if OmegaConf.is_missing(cfg.data, "num_classes"):
                cfg = load_config(REPO / "configs", [*overrides, "data.num_classes=5"], inputs=None)
            run = resolve(cfg, {}, GPUS if "trainer.devices=2" in overrides else 1)[0]
        except Exception as exc:  # a bad override or layout: the command and why
            pytest.fail(f"{' '.join(call)}: {type(exc).__name__}: {exc}")
        assert run.accelerator == "cuda", call
    for call in scripts:
        try:
            _accepts(REPO / call[0], call[1:])
        except SystemExit as exc:
            pytest.fail(f"{' '.join(call)}: its arguments are refused (exit {exc.code})")


def test_the_memory_rows_run_end_to_end_on_the_cpu(tmp_path):
    """benchmarks/memory_model.py's CUDA rows (run.sh memory) with a tiny ViT on the CPU, two of
    them (an accumulated one, a tensor-parallel one with its variant): each row's tools/benchmark.py
    command runs and its results carry the plan's figure for the layout beside the measured peak."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "memory_model.py"),
            "--smoke",
            "--rows",
            "vit_base+accum,vit_base+tp2",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.stdout[-4000:], result.stderr[-3000:])
    rows = [line for line in result.stdout.splitlines() if line.startswith("| vit_base")]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| vit_base+accum", "-"],
        ["| vit_base+tp2", "-"],
        ["| vit_base+tp2", "parallel.activation_checkpointing=true"],
    ]
    assert all(float(r.split(" | ")[3]) > 0 for r in rows)  # planned GB
