"""Top-5 is reported only where five guesses are well below the class count (more than 10 classes):
tools/eval.py on 6 and on 20 classes, its printed result, eval.log and eval.json (training runs:
tests/multirank/test_report.py); the summary prints its paths whole below the table."""

import json

import pytest
from helpers import REPO, call_tool, random_imagefolder

CONFIGS = REPO / "configs"


@pytest.mark.parametrize("classes", [6, 20])
def test_eval_reports_top5_only_above_ten_classes(tmp_path, capsys, classes):
    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.weights import save_weights

    root = random_imagefolder(tmp_path / "data", classes)
    args = [
        "model=vit_tiny",
        "model.depth=1",
        "data=imagenet",
        f"data.root={root}",
        "data.img_size=32",
        "data.num_workers=0",
        "trainer.accelerator=cpu",
        "trainer.progress=false",
    ]
    cfg = load_config(CONFIGS, args, inputs="eval")
    save_weights(build_model(cfg.model).state_dict(), tmp_path / "w.safetensors")
    out = tmp_path / "out"
    code, stdout, err = call_tool(
        capsys, "eval", f"weights={tmp_path / 'w.safetensors'}", *args, f"trainer.output_dir={out}"
    )
    assert code == 0, (stdout[-3000:], err)
    (result,) = (out / "eval").glob("*/eval.json")
    metrics = json.loads(result.read_text())
    log = (result.parent / "eval.log").read_text()
    final = next(line for line in stdout.splitlines() if line.startswith("val top-1:"))
    assert metrics["val_count"] == classes
    if classes > 10:
        assert (
            0 <= metrics["val_top1"] <= metrics["val_top5"] <= 100
            and "top-5: " in final
            and "| top-5 " in log
        )
    else:
        assert "val_top5" not in metrics and "top-5" not in final and "top-5" not in log


def test_the_summary_prints_its_paths_whole_below_the_table(capsys):
    from visiondist.observe.summary import print_summary

    run = "/runs/" + "/".join(f"a_rather_long_folder_name_{i}" for i in range(6))
    print_summary(
        {
            "model": "vit_tiny",
            "data": "shapes: 96 train / 30 val images",
            "val top-1 (%)": 59.2,
            "checkpoint": f"{run}/checkpoints/step_279",
            "best val_top1": "59.2 at step 186",
            "best checkpoint": f"{run}/checkpoints/step_186",
            "weights": f"{run}/model.safetensors",
            "run dir": run,
        }
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == [
        f"checkpoint: {run}/checkpoints/step_279",
        f"best checkpoint: {run}/checkpoints/step_186",
        f"weights: {run}/model.safetensors",
    ]
    table = "\n".join(lines[:-3])
    assert "59.2 at step 186" in table and "a_rather_long" not in table and "run dir" not in table
