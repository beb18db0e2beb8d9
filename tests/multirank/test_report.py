"""What a training run reports, through tools/train.py: top-5 only above 10 classes (the log lines,
metrics.csv and so curves.png, the summary, the final line), on the built-in 6-class set and on a
20-class ImageFolder tree."""

import json
import re

import pytest
from helpers import TINY_DATA, random_imagefolder, run_cli

from visiondist.observe.metrics import read_metrics


@pytest.mark.parametrize("classes", [6, 20])
def test_top5_is_reported_only_above_ten_classes(tmp_path, tiny_shapes, classes):
    data = (
        [*TINY_DATA, f"data.root={tiny_shapes}"]
        if classes == 6
        else [
            *(a for a in TINY_DATA if not a.startswith("data.synthetic.")),
            "data=imagenet",
            f"data.root={random_imagefolder(tmp_path / 'data', classes, train_per_class=2)}",
            "data.batch_size=8",
            "data.eval_batch_size=8",
        ]
    )
    run = tmp_path / "run"
    result = run_cli(
        [
            *data,
            "trainer.max_steps=2",
            "trainer.eval_every=1",
            "trainer.loggers=[csv]",
            "trainer.accelerator=cpu",
            f"trainer.run_dir={run}",
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    evals = [line for line in result.stdout.splitlines() if line.startswith("eval  step")]
    final = next(line for line in result.stdout.splitlines() if line.startswith("val top-1:"))
    summary = json.loads((run / "summary.json").read_text())
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert len(evals) == 2 and "val_top1" in header
    if classes > 10:
        assert (
            all("| top-5 " in line for line in evals)
            and "top-5: " in final
            and "val top-5 (%)" in summary
        )
        assert [
            r["val_top5"] is not None
            for r in read_metrics(run / "metrics.csv")
            if r["val_top1"] is not None
        ] == [True, True]
    else:
        assert not any("top-5" in line for line in evals) and "top-5" not in final
        assert (
            "val top-5 (%)" not in summary
            and "val_top5" not in header
            and "val_ema_top5" not in header
        )


def test_an_epoch_limited_run_writes_its_checkpoint_and_weights_before_the_last_evaluation(
    tmp_path, tiny_shapes
):
    """RELIABILITY.md's "nothing is lost": at the end of the last epoch (an evaluation is due there
    too) the checkpoint and model.safetensors come first; the evaluation after an earlier epoch
    still runs at once. train.log also holds the layout line the console printed before the run dir
    existed (once on the console), and every rate has one decimal."""
    run = tmp_path / "run"
    result = run_cli(
        [
            *TINY_DATA,
            f"data.root={tiny_shapes}",
            "data.batch_size=16",
            "trainer.max_epochs=2",
            "trainer.log_every=2",
            "trainer.loggers=[csv]",
            "trainer.accelerator=cpu",
            f"trainer.run_dir={run}",
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    log = [
        line.split(": ", 1)[1]
        for line in (run / "train.log").read_text().splitlines()
        if ": " in line
    ]
    order = [i for i, line in enumerate(log) if line.startswith(("eval  step", "saved checkpoint"))]
    assert [log[i].split(" |")[0] for i in order] == [
        "eval  step 6",
        f"saved checkpoint {run}/checkpoints/step_12",
        "eval  step 12",
    ], [log[i] for i in order]
    # in the console's words
    chose = [line for line in log if line.startswith("parallel=auto chose")]
    assert len(chose) == 1
    assert chose[0].startswith("parallel=auto chose plain DDP on 1 rank (cpu): ")
    assert result.stdout.count("parallel=auto chose") == 1 and chose[0] in result.stdout
    lines = [line.split(" | ") for line in log if line.startswith("step ")]
    rates = [next(part for part in line if part.endswith("img/s")) for line in lines]
    assert rates and all(re.fullmatch(r"\d+\.\d img/s", r) for r in rates), rates
    # each window's share of waiting for its input: in metrics.csv, on the log line from 10%, and
    # the steady state's (the windows after the first) in the summary
    rows = [r for r in read_metrics(run / "metrics.csv") if r.get("loss") is not None]
    waits = [r["data_wait"] for r in rows]
    assert len(waits) == 6 and all(0 <= w <= 1 for w in waits), waits
    for line, wait in zip(lines, waits):
        shown = [part for part in line if part.startswith("data wait ")]
        assert shown == ([f"data wait {100 * wait:.0f}%"] if wait >= 0.1 else []), line
    summary = json.loads((run / "summary.json").read_text())
    steady = summary["waiting for data, steady state (%)"]
    assert steady == pytest.approx(100 * sum(waits[1:]) / 5, abs=0.1)
