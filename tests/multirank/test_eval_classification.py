"""Classification metrics are exact under any number of ranks: 1, 2 and 3 ranks on 31 validation
images give the same top-1 / top-5 / per-class numbers as scoring every image one by one in one
process, the confusion matrix too."""

import eval_ranks
import numpy as np
import pytest
import torch
from helpers import spawn_ranks
from PIL import Image


@pytest.fixture(scope="module")
def val_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(0)
    for c, n in enumerate(eval_ranks.PER_CLASS):
        (root / "val" / f"class{c}").mkdir(parents=True)
        for i in range(n):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "val" / f"class{c}" / f"{i}.png")
    return root


def _direct(root):
    """One image at a time, top-k by sorting the logits: no shared code with the evaluator but the
    transform and the normalisation."""
    from visiondist.data import build_classification_data

    cfg = eval_ranks.data_config(str(root))
    data = build_classification_data(cfg, 32, 0, 1, 1, 0, False)
    model, dataset, normalize = (
        eval_ranks.make_model(),
        data.val_loader.dataset,
        eval_ranks.inputs(cfg),
    )
    top1 = top5 = loss = 0.0
    per_class, margins = np.zeros((eval_ranks.CLASSES, 2)), []
    confusion = np.zeros((eval_ranks.CLASSES, eval_ranks.CLASSES), dtype=int)
    with torch.no_grad():
        for i in range(len(dataset)):
            image, label = dataset[i]
            logits = model(normalize(image[None], torch.device("cpu")))[0]
            order = torch.argsort(logits, descending=True).tolist()
            # the ranks score batches of other sizes (other GEMM blockings: round-off near 1e-6);
            # the exact comparisons below hold on any CPU because no decision of top-1 or top-5 is
            # nearer than that
            ranked = logits.sort(descending=True).values
            margins.append(float(min(ranked[0] - ranked[1], ranked[4] - ranked[5])))
            top1 += order[0] == label
            top5 += label in order[:5]
            loss += torch.nn.functional.cross_entropy(logits[None], torch.tensor([label])).item()
            per_class[label] += (order[0] == label, 1)
            confusion[label, order[0]] += 1
    n = len(dataset)
    assert min(margins) > 1e-4, min(margins)  # 1.4e-3 on the CPU where it was written
    return {
        "val_top1": 100 * top1 / n,
        "val_top5": 100 * top5 / n,
        "val_loss": loss / n,
        "val_count": n,
        "val_class_top1": list(100 * per_class[:, 0] / per_class[:, 1]),
        "val_class_count": [int(c) for c in per_class[:, 1]],
        "val_confusion": confusion.tolist(),
    }


def test_topk_is_exact_for_any_number_of_ranks(val_root):
    direct = _direct(val_root)
    assert direct["val_count"] == 31 and 0 < direct["val_top1"] < direct["val_top5"] < 100
    for world in (1, 2, 3):
        results = spawn_ranks(eval_ranks.run, world, str(val_root))
        seen = sorted(i for r in results.values() for i in r["seen"])
        assert seen == list(range(31)), world  # every image exactly once
        for r in results.values():
            m = r["metrics"]
            assert m["val_count"] == 31
            assert m["val_top1"] == pytest.approx(direct["val_top1"], abs=1e-9)
            assert m["val_top5"] == pytest.approx(direct["val_top5"], abs=1e-9)
            assert m["val_loss"] == pytest.approx(direct["val_loss"], rel=1e-5)
            assert m["val_class_count"] == direct["val_class_count"] == eval_ranks.PER_CLASS
            assert m["val_class_top1"] == pytest.approx(direct["val_class_top1"], abs=1e-9)
            # row: the true class, column: the predicted one; some images misclassified
            assert m["val_confusion"] == direct["val_confusion"]
