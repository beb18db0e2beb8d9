"""benchmarks/gpu/table.py: the one table `run.sh mfu` and `run.sh levers` end with, which fails a
run that timed eager code or lost a goal row."""

import pytest
from helpers import REPO


def test_the_mfu_table_fails_a_row_compiled_with_faults_and_a_missing_goal_row(
    tmp_path, capsys, monkeypatch
):
    """benchmarks/gpu/table.py, `run.sh mfu`'s last word: a line per row with its goal and whether
    it is met; its exit code counts the rows compiled with faults (a graph break, a recompile-limit
    hit: eager code timed) and the goal rows missing, so such a run never passes for a
    measurement."""
    import json
    import runpy

    def row(model, variant="-", **values):
        return {
            "device": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0",
            "model": model,
            "variant": variant,
            "img_size": 224,
            "batch": 64 if model == "vit_huge" else 256,
            "compile_scope": "model",
            "images_per_s": 1000.0,
            "mfu_datasheet": 0.4,
            "ours_over_plain": 1.0,
            "over_first": 1.0,
            "compile_faults": [],
            **values,
        }

    rows = [
        row("vit_small", images_per_s=10_500.0, ours_over_plain=0.95),
        row("vit_base", images_per_s=3_000.0),
        row("vit_huge", mfu_datasheet=0.51),
        row("vit_huge", "trainer.fp8=rowwise", over_first=1.1),
    ]

    def table(rows, *flags) -> tuple[int, str]:
        results = tmp_path / "results.jsonl"
        results.write_text("".join(json.dumps(r) + "\n" for r in rows))
        monkeypatch.setattr(
            "sys.argv", ["table.py", str(results), "--markdown", str(tmp_path / "mfu.md"), *flags]
        )
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(str(REPO / "benchmarks" / "gpu" / "table.py"), run_name="__main__")
        capsys.readouterr()
        return ended.value.code, (tmp_path / "mfu.md").read_text()

    code, text = table(rows)
    assert code == 0, text
    met = {
        line.split("|")[1].strip(): line.split("|")[-2].strip()
        for line in text.splitlines()
        if "| vit_" in line
    }
    assert met == {
        "vit_small 224 b256": "yes",
        "vit_base 224 b256": "no",
        "vit_huge 224 b64": "yes",
        # ViT-S at 1.05x plain: the goals' 1.0x too
        "vit_huge 224 b64 trainer.fp8=rowwise": "no",
    }, text
    rows[1]["compile_faults"] = ["ours: recompile limit hit (8) in forward"]
    code, text = table(rows)
    assert code == 1 and "FAILED: ours: recompile limit hit (8) in forward" in text, text
    code, text = table(rows[:2])
    assert (
        code == 3
        and (
            "missing rows (not run or failed before recording): vit_huge -, "
            "vit_huge trainer.fp8=rowwise"
        )
        in text
    ), text
    # `run.sh levers`: each row's speed over its run's first (a step-time ratio in the JSON), no
    # goals, no missing rows
    levers = [
        row("vit_base"),
        row(
            "vit_base",
            "trainer.compile_autotune=true",
            over_first=0.8,
            ratio_uncertainty={"over_first": 0.012},
        ),
    ]
    code, text = table(levers, "--levers")
    speeds = {
        line.split("|")[1].strip(): line.split("|")[5].strip()
        for line in text.splitlines()
        if "| vit_" in line
    }
    assert code == 0 and speeds == {
        "vit_base 224 b256": "1.000",
        "vit_base 224 b256 trainer.compile_autotune=true": "1.250 (+-1.2%)",
    }, text
    levers[1]["compile_faults"] = ["ours: graph break in forward"]
    assert table(levers, "--levers")[0] == 1
