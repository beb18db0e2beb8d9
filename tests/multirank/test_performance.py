"""The benchmark tool (real runs, real result files, FLOPs against the analytic count, pipeline
traffic against its analytic bytes) and the fast-path switches (each gives the same numbers as the
path it replaces)."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, TINY_DATA, run_cli

from visiondist.models.flops import vit_train_flops
from visiondist.models.shape import ViTShape

BENCH = REPO / "tools" / "benchmark.py"


def _bench(tiny_shapes, tmp_path, *extra: str, rows: int = 1, timeout: float = 300) -> list[dict]:
    results = tmp_path / "results"
    args = [
        *TINY_DATA,
        f"data.root={tiny_shapes}",
        "trainer.accelerator=cpu",
        "trainer.loggers=[csv]",
        f"trainer.output_dir={tmp_path / 'runs'}",
        "bench.warmup=1",
        "bench.steps=2",
        "bench.rounds=2",
        "bench.loader_batches=2",
        f"bench.results_dir={results}",
        *extra,
    ]
    out = run_cli(args, timeout=timeout, script=BENCH)
    assert out.returncode == 0, out.stdout[-4000:]
    lines = (results / "results.jsonl").read_text().splitlines()
    md = (results / "results.md").read_text().splitlines()
    assert len(lines) == rows and len(md) == 2 + rows  # header, rule, a row per configuration
    assert md[0].startswith("| date | device | model")
    return [
        {**json.loads(line), "md_row": row, "stdout": out.stdout}
        for line, row in zip(lines, md[2:])
    ]


def test_each_configuration_is_timed_against_its_own_plain_loops_in_alternating_order(
    tiny_shapes, tmp_path
):
    """The compiled variant's plain loops compile the whole model too (timm's as its train.py does,
    ours as visiondist compiles it: trainer.compile=true on one device), with no graph break or
    recompile-limit hit in any loop (the row's compile_faults, from dynamo's counters), each ratio
    divides by its own configuration's loops, the harness / model split multiplies back to ours /
    plain, and the order of the loops is reversed and the configurations rotated from one round to
    the next. 4 timed steps: every ratio is flagged as not meaningful."""
    first, compiled = _bench(
        tiny_shapes,
        tmp_path,
        "data.batch_size=8",
        "bench.variants=['trainer.compile=true']",
        rows=2,
    )
    assert (first["variant"], compiled["variant"]) == ("-", "trainer.compile=true")
    assert first["order"] == [
        [
            "0:ours",
            "0:plain_same_model",
            "0:plain_reference",
            "1:ours",
            "1:plain_same_model",
            "1:plain_reference",
        ],
        [
            "1:plain_reference",
            "1:plain_same_model",
            "1:ours",
            "0:plain_reference",
            "0:plain_same_model",
            "0:ours",
        ],
    ]
    for r, scope in ((first, "none"), (compiled, "whole model")):
        ref, same = r["plain_reference"], r["plain_same_model"]
        assert r["compile_faults"] == ref["compile_faults"] == same["compile_faults"] == []
        assert (ref["model"], same["model"]) == (
            "timm vit_tiny_patch16_224",
            "visiondist VisionTransformer",
        )
        assert ref["built_from"] == same["built_from"] == r["variant"]
        assert r["compile_scope"] == ref["compile_scope"] == same["compile_scope"] == scope
        # torch >= 2.4, CPU
        assert r["optimizer"] == ref["optimizer"] == same["optimizer"] == "adamw (auto: fused)"
        assert r["steps_timed"] == ref["steps_timed"] == same["steps_timed"] == 4
        ours_ms, ref_ms, same_ms = (
            r["step"]["median_ms"],
            ref["step"]["median_ms"],
            same["step"]["median_ms"],
        )
        assert r["ours_over_plain"] == pytest.approx(ours_ms / ref_ms)
        assert r["harness_overhead"] == pytest.approx(ours_ms / same_ms)
        assert r["model_difference"] == pytest.approx(same_ms / ref_ms)
        assert r["harness_overhead"] * r["model_difference"] == pytest.approx(r["ours_over_plain"])
        assert r["images_per_s"] == pytest.approx(8 / (ours_ms / 1e3))
        # the counted FLOPs of the depth-2 ViT-Ti at 32 px equal the analytic count the planner runs
        # on
        assert r["gflops_per_image"] * 1e9 == pytest.approx(
            vit_train_flops(ViTShape(192, 2, 3, 4.0, 16, 32, 6)), rel=1e-9
        )
        assert r["tflops_per_device"] == pytest.approx(
            r["gflops_per_image"] * r["images_per_s"] / 1e3
        )
        # CPU
        assert (
            r["peak_kind"] == "fp32"
            and r["peak_tflops_datasheet"] is None
            and r["mfu_datasheet"] is None
        )
        assert r["mfu_matmul"] == pytest.approx(r["tflops_per_device"] / r["peak_tflops_matmul"])
        assert r["tp_bytes_per_step"] == r["pp_bytes_per_step"] == r["dp_bytes_per_step"] == 0
        assert not r["ratio_reliable"] and "fewer than 5" in r["ratio_warnings"]["harness_overhead"]
        assert (
            f"| {r['batch']} | {r['images_per_s']:.4g} |" in r["md_row"]
            and "(noisy)" in r["md_row"]
        )
    assert compiled["over_first"] == pytest.approx(
        compiled["step"]["median_ms"] / first["step"]["median_ms"]
    )
    # and whether it keeps up with the step, in the caption and the row
    assert first["loader_images_per_s"] > 0
    assert first["loader_over_step"] == pytest.approx(
        first["loader_images_per_s"] / first["images_per_s"]
    )
    out = first["stdout"]
    assert f"({first['loader_over_step']:.2f}x the step's)" in first["md_row"]
    assert ("WARNING the base configuration: the loader delivers" in out) == (
        first["loader_over_step"] < 1.2
    )
    assert compiled["loader_images_per_s"] > 0  # each configuration's own loader
    assert (
        "plain loop, timm" in out
        and "MFU matmul" in out
        and "WARNING trainer.compile=true: not meaningful" in out
    )


def test_benchmark_reports_pipeline_traffic_from_the_counter(tiny_shapes, tmp_path):
    """pp2: rank 0 (the first stage) sends each micro-batch's activation once per step; no
    single-device baseline."""
    (r,) = _bench(
        tiny_shapes,
        tmp_path,
        "data.batch_size=16",
        "parallel=pp2",
        "parallel.microbatches=2",
        timeout=400,
    )
    assert (
        r["ranks"] == 2
        and r["plain_reference"] is r["plain_same_model"] is r["ours_over_plain"] is None
    )
    micro = 16 // 2  # global batch / micro-batches
    tokens = (32 // 16) ** 2 + 1
    assert r["pp_bytes_per_step"] == 2 * micro * tokens * 192 * 4  # 2 micro-batches forward, fp32
    assert r["tp_bytes_per_step"] == 0


def test_benchmark_variants_that_change_the_layout_are_refused(tmp_path):
    out = run_cli(["bench.variants=['parallel.tp=2']"], timeout=60, script=BENCH)
    assert out.returncode == 2 and "would change the ranks, the mesh or the batch" in out.stdout
