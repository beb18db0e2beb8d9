"""What a training run reports, through tools/train.py: top-5 only above 10 classes (the log lines, metrics.csv and
so curves.png, the summary, the final line), on the built-in 6-class set and on a 20-class ImageFolder tree."""

import json

import pytest

from helpers import TINY_DATA, random_imagefolder, run_cli
from visiondist.observe.metrics import read_metrics


@pytest.mark.parametrize("classes", [6, 20])
def test_top5_is_reported_only_above_ten_classes(tmp_path, tiny_shapes, classes):
    data = ([*TINY_DATA, f"data.root={tiny_shapes}"] if classes == 6 else
            [*(a for a in TINY_DATA if not a.startswith("data.synthetic.")), "data=imagenet",
             f"data.root={random_imagefolder(tmp_path / 'data', classes, train_per_class=2)}", "data.batch_size=8", "data.eval_batch_size=8"])
    run = tmp_path / "run"
    result = run_cli([*data, "trainer.max_steps=2", "trainer.eval_every=1", "trainer.loggers=[csv]",
                      "trainer.accelerator=cpu", f"trainer.run_dir={run}"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    evals = [line for line in result.stdout.splitlines() if line.startswith("eval  step")]
    final = next(line for line in result.stdout.splitlines() if line.startswith("val top-1:"))
    summary = json.loads((run / "summary.json").read_text())
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert len(evals) == 2 and "val_top1" in header
    if classes > 10:
        assert all("| top-5 " in line for line in evals) and "top-5: " in final and "val top-5 (%)" in summary
        assert [r["val_top5"] is not None for r in read_metrics(run / "metrics.csv") if r["val_top1"] is not None] \
            == [True, True]
    else:
        assert not any("top-5" in line for line in evals) and "top-5" not in final
        assert "val top-5 (%)" not in summary and "val_top5" not in header and "val_ema_top5" not in header
