"""What a layout run on GPUs must also show, beside the layout tests of the other files (all marked
`layouts`, run on the CPU here and with the ranks on a GPU by `benchmarks/gpu/run.sh layouts` /
`multi`: tests/devices.py):

- a detector (Faster R-CNN, and RT-DETR of the DETR class) trained under dp2 evaluates on one rank
  exactly as its run's own 2-rank evaluation did. A device run's extra: on the CPU (for CI's time)
  only with VISIONDIST_TEST_DEVICE set (`VISIONDIST_TEST_DEVICE=cpu` runs it here);
- no layout's training step reads a device tensor on the host (a synchronisation of every step on a
  GPU);
- benchmarks/gpu/run.sh's `layouts` and `multi` modes parse and run the `layouts` tests, and the
  ViT-H/14 benchmark of `multi` resolves to its TP layout, whose traffic benchmarks/gpu/traffic.py
  plans.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from devices import on_test_device
from helpers import REPO, TINY_DATA, losses_of, run_cli

from visiondist.observe.metrics import read_metrics

RUN_SH = REPO / "benchmarks" / "gpu" / "run.sh"
DEVICE_RUN = pytest.mark.skipif(
    "VISIONDIST_TEST_DEVICE" not in os.environ,
    reason="a device run's check (benchmarks/gpu/run.sh layouts); "
    "VISIONDIST_TEST_DEVICE=cpu runs it on the CPU",
)


DETECTORS = {
    "fasterrcnn": [
        "model=fasterrcnn_mobilenet_v3",
        "+model.kwargs.box_score_thresh=0.0",
        "model.roi_sampling_ratio=null",
    ],
    "rtdetr": [
        "model=rtdetr_v2_r18",
        "model.img_size=64",
        "model.multi_scale=null",
        "model.num_queries=50",
        "schedule.warmup_steps=1",
    ],
}


LAYOUTS = {
    "dp2": ["parallel.dp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "fsdp2": ["parallel.dp=2", "parallel.fsdp=true"],
    "pp2": ["parallel.pp=2"],
    "tp2_native_packed": [
        "parallel.tp=2",
        "data.resolution=native",
        "model.patch_size=8",
        "data.native.pack=true",
        "data.batch_size=2",
    ],
}


@pytest.mark.layouts
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_no_layouts_training_step_reads_the_device_on_the_host(tmp_path, name):
    """Each layout's step (its collectives, clipping over its shards, the pipeline's schedule, the
    optimizer) on 2 ranks, with every operator that reads a tensor's values on the host recorded on
    each rank (`HostReads`): none. On a GPU each would hold the host until the device caught up,
    every step; the CPU shows them without one. data.num_workers=0: the collate runs in the rank,
    where its host tensors' reads would count."""
    from host_reads import steps_reading_the_host

    from visiondist.cli import load_config
    from visiondist.launch import launch

    args = on_test_device(
        [
            *TINY_DATA,
            "data.synthetic.max_aspect=3",
            "model.num_heads=2",
            "data.batch_size=8",
            f"data.root={tmp_path / 'data'}",
            f"trainer.run_dir={tmp_path / 'run'}",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.max_steps=20",
            *LAYOUTS[name],
        ]
    )
    launch(steps_reading_the_host, load_config(REPO / "configs", args))


@DEVICE_RUN
@pytest.mark.layouts
@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_a_detector_trained_under_dp2_evaluates_on_one_rank_as_on_two(tmp_path, name):
    """2 steps under dp2 (every loss finite), then tools/eval.py on one rank: the 12 COCO stats and
    the detection count equal the run's final 2-rank evaluation's (one image per rank and batch
    either way: a batch's composition changes the convolutions' rounding)."""
    if name == "rtdetr":
        pytest.importorskip("transformers")
    run = tmp_path / "run"
    args = on_test_device(
        [
            *DETECTORS[name],
            "data=shapes_coco",
            f"data.root={tmp_path / 'data'}",
            "data.synthetic.train_images=16",
            "data.synthetic.val_images=10",
            "data.synthetic.image_size=64",
            "data.min_size=64",
            "data.max_size=64",
            "data.batch_size=4",
            "data.eval_batch_size=2",
            "data.num_workers=0",
            "trainer.max_steps=2",
            "trainer.log_every=1",
            "trainer.accelerator=cpu",
            "trainer.progress=false",
            "trainer.loggers=[csv]",
            "parallel.dp=2",
            "trainer.devices=2",
            f"trainer.run_dir={run}",
        ]
    )
    out = run_cli(args, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
    assert re.search(r"layout dp=2 tp=1 pp=1 \(2 ranks on ", out.stdout), out.stdout[-2000:]
    losses = losses_of(run)
    assert sorted(losses) == [1, 2] and all(v == v and v > 0 for v in losses.values()), losses
    final = [r for r in read_metrics(run / "metrics.csv") if r.get("val_mAP") is not None][-1]
    assert final["val_detections"] > 0
    one = run_cli(
        [f"run_dir={run}", "trainer.devices=1", "parallel.dp=1", "data.eval_batch_size=1"],
        timeout=300,
        script=REPO / "tools" / "eval.py",
    )
    assert one.returncode == 0, one.stdout[-4000:]
    stats = json.loads(next((run / "eval").glob("*/eval.json")).read_text())
    for key, value in final.items():
        if key.startswith("val_") and value is not None:
            assert stats[key] == value, (key, stats[key], value)


def test_run_sh_layouts_and_multi_parse_and_run_the_layout_tests():
    """`bash -n` passes; both modes run the `layouts` marker's tests (run.sh's `layout_tests`), and
    that marker selects every layout the modes promise (and this file's own tests)."""
    subprocess.run(["bash", "-n", str(RUN_SH)], check=True)
    text = RUN_SH.read_text()
    selection = re.search(r"^layout_tests=\(([^)]*)\)", text, flags=re.M)
    assert selection, "run.sh defines no layout_tests=(...)"
    for mode in ("layouts", "multi"):
        section = re.search(rf"^if has {mode}; then.*?$(.*?)^fi$", text, flags=re.M | re.S)
        assert section and '"${layout_tests[@]}"' in section[1], (
            f"run.sh {mode} does not run the layout tests"
        )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            *selection[1].split(),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    marked = [line for line in result.stdout.splitlines() if "::" in line]
    for layout in (
        "test_dp2_equals_dp1",
        "test_tp2_matches_one_process[tp2]",
        "test_tp2_matches_one_process[tp2-sp]",
        "test_every_schedule_matches_one_process[2]",
        "test_pipelined_run_equals_one_process[zero_bubble]",
        "test_fsdp_run_equals_ddp",
        "test_hsdp_2x2_run_equals_one_process",
        "test_dp2_tp2_with_sequence_parallel_equals_dp1",
        "test_vitdet_backbone_under_tp_gives_the_single_process_features[tp2]",
        "test_compiled_blocks_under_tp2_match_one_process",
        "in_bf16_matches_one_process",
        "test_checkpoint_reshards_to_other_layouts[parallel=tp2]",
        "test_distributed_eval_equals_one_process_and_pycocotools[2]",
        "[fasterrcnn]",
        "[rtdetr]",
        "test_a_killed_rank_ends_the_job_within_a_minute_naming_it",
        "test_sigterm_during_a_step",
    ):
        assert any(layout in test for test in marked), (layout, marked)


@pytest.mark.parametrize("gpus", [2, 8])
def test_run_sh_multi_benchmark_config_resolves_and_its_traffic_is_planned(gpus):
    """run.sh multi's ViT-H/14 benchmark (its overrides as the script sets them for `gpus` GPUs)
    composes and resolves to one TP group of 4 (2 on 2 GPUs) on that many GPUs, and
    benchmarks/gpu/traffic.py plans its bytes."""
    import importlib.util

    from visiondist.cli import load_config
    from visiondist.plan import resolve

    text = RUN_SH.read_text()
    tp = 4 if gpus >= 4 else 2
    assert re.search(r"^\s+tp=\$\(\(gpus >= 4 \? 4 : 2\)\)$", text, flags=re.M)

    # bash's words of a line of the script, $tp as set for `gpus`
    def words(found: str) -> list[str]:
        return found.replace('"', "").replace("$tp", str(tp)).split()

    vith = words(re.search(r"^\s+vith=\((.*)\)$", text, flags=re.M)[1])
    bench = words(
        re.search(
            r'tools/benchmark.py trainer.accelerator=cuda bench.results_dir="\$out/multi" \\\n'
            r'\s+"\$\{vith\[@\]\}" (.*)$',
            text,
            flags=re.M,
        )[1]
    )
    cfg = load_config(REPO / "configs", [*vith, "trainer.accelerator=cuda", *bench], inputs=None)
    run = resolve(cfg, {}, gpus)[0]
    assert (run.world_size, run.dp, run.tp, run.pp, run.accelerator) == (tp, 1, tp, 1, "cuda")
    spec = importlib.util.spec_from_file_location(
        "traffic", REPO / "benchmarks" / "gpu" / "traffic.py"
    )
    traffic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(traffic)
    plan = traffic.planned(vith, tp)
    assert plan["tp_bytes_per_step"] > 1e8 and plan["pp_bytes_per_step"] == 0, plan
