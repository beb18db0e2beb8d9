"""How `tools/benchmark.py` reports: step-time summaries, when a ratio of two medians means
something, the table it prints and the rows it appends to results.jsonl / results.md.

A ratio is marked not meaningful (`ratio_reliable: false` in the JSON, `~` and "(noisy)" in the
tables, a warning under the table) when either side has fewer than `MIN_TIMED_STEPS` timed steps, or
when the ratio's uncertainty exceeds `MAX_RATIO_UNCERTAINTY`. The uncertainty is two standard errors
of the ratio of the medians (about a 95% interval): each median's relative standard error is 1.25
sigma / sqrt(n) / median, sigma estimated from the interquartile range (IQR / 1.35) so that one
stray step does not inflate it, and the two add in quadrature. Below 5 steps neither that estimate
nor the sample's range bounds the median (the range [min, max] of n steps covers the median with
probability 1 - 2 * 0.5**n: 88% at 4, 75% at 3). At +-10% a ratio cannot tell a 10% overhead from
none: that is the question these ratios answer, so a noisier one is flagged. A run of 3 steps spread
over 353-8369 ms around 860 ms fails both tests.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

MIN_TIMED_STEPS = 5
MAX_RATIO_UNCERTAINTY = 0.10


def step_summary(times: list[float]) -> dict[str, float]:
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times),
        "std_ms": 1e3 * (statistics.stdev(times) if len(times) > 1 else 0.0),
    }


def median_uncertainty(times: list[float]) -> float:
    """Relative standard error of the median of `times` (needs 2 or more)."""
    q1, _, q3 = statistics.quantiles(times, n=4)
    return 1.2533 * (q3 - q1) / 1.349 / math.sqrt(len(times)) / statistics.median(times)


def ratio_check(
    numerator: list[float], denominator: list[float]
) -> tuple[float | None, str | None]:
    """(the relative uncertainty of median(numerator) / median(denominator), about 95%; why the
    ratio means nothing, or None when it does)."""
    fewest = min(len(numerator), len(denominator))
    uncertainty = (
        2 * math.hypot(median_uncertainty(numerator), median_uncertainty(denominator))
        if fewest >= 2
        else None
    )
    if fewest < MIN_TIMED_STEPS:
        return (
            uncertainty,
            f"{fewest} timed steps, fewer than {MIN_TIMED_STEPS}: the medians are not bounded",
        )
    if uncertainty is not None and uncertainty > MAX_RATIO_UNCERTAINTY:
        return (
            uncertainty,
            f"the step times spread too much: uncertain by more than +-{MAX_RATIO_UNCERTAINTY:.0%}",
        )
    return uncertainty, None


def ratio_text(r: dict[str, Any], key: str, digits: int = 3) -> str:
    """A ratio as the tables show it: "0.984 +-6%", or "~7.1 (noisy)" when it is not meaningful, or
    "-"."""
    value = r.get(key)
    if value is None:
        return "-"
    uncertainty = r["ratio_uncertainty"].get(key)
    if key in r["ratio_warnings"]:
        return f"~{value:.3g} (noisy)"
    return f"{value:.{digits}f}" + (f" +-{uncertainty:.0%}" if uncertainty is not None else "")


def _with_uncertainty(r: dict[str, Any], key: str) -> str:
    uncertainty = r["ratio_uncertainty"].get(key)
    return key if uncertainty is None else f"{key} (+-{uncertainty:.0%})"


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec) + suffix
    )


def _pct(value: float | None) -> str:
    return _fmt(value and 100 * value, ".1f", "%")


MD_HEADER = (
    "| date | device | model | px | layout | variant | precision | compile | optimizer | batch | "
    "img/s | step ms (median, min-max) | GFLOP/img | TFLOP/s | MFU datasheet | MFU matmul | peak "
    "mem (GB) | plain loop img/s | ours/plain | harness: ours/plain same model | model: plain "
    "same/plain reference | loader img/s "
    "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def markdown_row(r: dict[str, Any]) -> str:
    s, plain = r["step"], r["plain_reference"] or r["plain_same_model"]
    plain_text = f"{plain['images_per_s']:.4g} ({plain['model']})" if plain else "-"
    precision = r["precision"] + (f" + fp8 {r['fp8']}" if r.get("fp8", "off") != "off" else "")
    return (
        f"| {r['date']} | {r['device']} | {r['model']} | {r['img_size']} | {r['layout']} | "
        f"{r['variant']} | {precision} | "
        f"{r['compile_scope']}{' (FAILED: compile faults)' if r.get('compile_faults') else ''} | "
        f"{r['optimizer']} | {r['batch']} | {r['images_per_s']:.4g} | {s['median_ms']:.1f} "
        f"({s['min_ms']:.1f}-{s['max_ms']:.1f}) | {r['gflops_per_image']:.4g} | "
        f"{r['tflops_per_device']:.3g} | {_pct(r['mfu_datasheet'])} | {_pct(r['mfu_matmul'])} | "
        f"{_fmt(r['peak_memory_gb'], '.2f')} | {plain_text} | {ratio_text(r, 'ours_over_plain')} "
        f"| {ratio_text(r, 'harness_overhead')} | {ratio_text(r, 'model_difference')} | "
        f"{_fmt(r['loader_images_per_s'], '.4g')}{_keeps_up(r)} |\n"
    )


def write_results(results: list[dict[str, Any]], results_dir: Path) -> None:
    """Append one JSON line per configuration to results.jsonl and one row each to results.md,
    starting a table with the header when the file has none of these columns yet."""
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / "results.jsonl", "a") as f:
        for result in results:
            f.write(json.dumps(result) + "\n")
    md = results_dir / "results.md"
    text = md.read_text() if md.exists() else ""
    with open(md, "a") as f:
        if MD_HEADER not in text:
            f.write(("\n" if text else "") + MD_HEADER)
        for result in results:
            f.write(markdown_row(result))


LOADER_MARGIN = 1.2  # the loader must outrun the step by this much, or the benchmark warns


def _keeps_up(r: dict[str, Any]) -> str:
    ratio = r.get("loader_over_step")
    return "" if ratio is None else f" ({ratio:.2f}x the step's)"


def _variant_loaders(results: list[dict[str, Any]]) -> str:
    rest = [
        f"{r['variant']}: {_fmt(r['loader_images_per_s'], '.4g')}{_keeps_up(r)}"
        + (
            " of JPEG bytes, the decode on the device"
            if "JPEG decode + crop + resize" in r.get("device_input", [])
            else ""
        )
        for r in results[1:]
        if r.get("loader_images_per_s") is not None
    ]
    return f" ({'; '.join(rest)})" if rest else ""


def _name(r: dict[str, Any]) -> str:
    return "the base configuration" if r["variant"] == "-" else r["variant"]


def _matcher_lines(results: list[dict[str, Any]]) -> list[str]:
    """A DETR's Hungarian matching beside its step (the criterion's host time)."""
    return [
        f"{_name(r)}: Hungarian matching {r['matcher_solve_ms']:.2f} ms a step on the host "
        f"({_pct(r['matcher_solve_share'])} of the step), after waiting "
        f"{r['matcher_wait_ms']:.2f} ms for the cost matrices (one transfer a step)"
        for r in results
        if r.get("matcher_solve_ms") is not None
    ]


def result_table(results: list[dict[str, Any]]):
    """One row per configuration, each followed by its own plain loops; shared figures and warnings
    in the caption."""
    first = results[0]
    peaks = "; ".join(
        sorted(
            {
                f"{r['peak_kind']}: datasheet {_fmt(r['peak_tflops_datasheet'], '.4g')}, matmul "
                f"{_fmt(r['peak_tflops_matmul'], '.3g')}"
                for r in results
            }
        )
    )
    caption = [
        f"{first['gflops_per_image']:.4g} GFLOP per image (forward + backward, counted); peak "
        f"TFLOP/s ({peaks}); loader alone {_fmt(first['loader_images_per_s'], '.4g')} "
        f"images/s{_keeps_up(first)}{_variant_loaders(results)}; per step: TP "
        f"{first['tp_bytes_per_step'] / 1e6:.2f} MB, PP {first['pp_bytes_per_step'] / 1e6:.2f} "
        f"MB, DP all-reduce {first['dp_bytes_per_step'] / 1e6:.2f} MB sent per rank; peak memory: "
        f"{first['memory_kind']}"
    ]
    for r in results:
        if r.get("device_input"):
            caption.append(
                f"{_name(r)}: visiondist's step includes the input work done on the device: "
                f"{', '.join(r['device_input'])} (the plain loops do the same augmentation on the "
                "device, with timm's Mixup and EMA where the recipe has them; they get decoded "
                "images)"
            )
    caption += _matcher_lines(results)
    for r in results:
        if r.get("loader_over_step") is not None and r["loader_over_step"] < LOADER_MARGIN:
            caption.append(
                f"WARNING {_name(r)}: the loader delivers {r['loader_over_step']:.2f}x the images "
                f"the step consumes, less than the {LOADER_MARGIN}x margin: the device may wait "
                "for data; raise data.num_workers, or move work to the device "
                "(data.augment_on=device, data.decode_on=device: docs/performance.md, "
                '"Feeding the GPU")'
            )
    for r in results:
        for fault in r.get("compile_faults", []):
            caption.append(
                f"FAILED {_name(r)}: {fault} (torch.compile: that loop's rate is not the compiled "
                "step's)"
            )
    for r in results:
        for why in dict.fromkeys(r["ratio_warnings"].values()):
            keys = ", ".join(
                _with_uncertainty(r, key)
                for key, reason in r["ratio_warnings"].items()
                if reason == why
            )
            caption.append(f"WARNING {_name(r)}: not meaningful, {why}: {keys}")
        # e.g. fp16 on a CPU: torch's square fp16 product is far slower than the step's
        if (r["mfu_matmul"] or 0) > 1:
            caption.append(
                f"WARNING {_name(r)}: MFU matmul {_pct(r['mfu_matmul'])}: the step outran the "
                "square matmul measured as the peak, which is then no ceiling for this device "
                "and precision"
            )
    table = Table(
        title=f"{first['model']} | {first['layout']} | batch {first['batch']} | {first['device']}",
        caption="\n".join(caption),
        show_header=True,
    )
    for name in (
        "",
        "optimizer",
        "compile",
        "images/s",
        "step ms",
        "min-max",
        "/ plain",
        "harness",
        "model",
        "/ first",
        "TFLOP/s",
        "MFU sheet",
        "MFU matmul",
        "peak GB",
        "planned GB",
    ):
        table.add_column(name, justify="left" if name in ("", "optimizer", "compile") else "right")
    for r in results:
        s = r["step"]
        table.add_row(
            "visiondist" + ("" if r["variant"] == "-" else f" {r['variant']}"),
            r["optimizer"],
            r["compile_scope"],
            f"{r['images_per_s']:.4g}",
            f"{s['median_ms']:.1f}",
            f"{s['min_ms']:.1f}-{s['max_ms']:.1f}",
            ratio_text(r, "ours_over_plain"),
            ratio_text(r, "harness_overhead"),
            ratio_text(r, "model_difference"),
            ratio_text(r, "over_first"),
            f"{r['tflops_per_device']:.3g}",
            _pct(r["mfu_datasheet"]),
            _pct(r["mfu_matmul"]),
            _fmt(r["peak_memory_gb"], ".2f"),
            _fmt(r.get("planned_gb"), ".2f"),
        )
        for role in ("plain_same_model", "plain_reference"):
            p = r[role]
            if p:
                s = p["step"]
                table.add_row(
                    f"  plain loop, {p['model']}",
                    p["optimizer"],
                    p["compile_scope"],
                    f"{p['images_per_s']:.4g}",
                    f"{s['median_ms']:.1f}",
                    f"{s['min_ms']:.1f}-{s['max_ms']:.1f}",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                    _fmt(p["peak_memory_gb"], ".2f"),
                    "",
                )
    return table
