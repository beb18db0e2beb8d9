"""The built-in data sets, generated on first use in the formats of the real ones and read by the
same loaders: `shapes` (ImageNet's folder layout, `shapes.py`) and `shapes_coco` (COCO instances
with boxes and masks, `shapes_coco.py`). Generation is deterministic and atomic (a folder is whole
or absent); a copy made by an earlier generator version is made again.

Imports: `data` (COCO's mask encoding), `utils`.
"""

from __future__ import annotations

from pathlib import Path

from visiondist.synthetic.shapes import conflict, ensure_shapes, spec_of_shapes
from visiondist.synthetic.shapes_coco import ensure_shapes_coco, spec_of_shapes_coco

# built-in datasets, generated on first use
GENERATORS = {"shapes": ensure_shapes, "shapes_coco": ensure_shapes_coco}
# data.synthetic -> the copy's dataset.json
SPECS = {"shapes": spec_of_shapes, "shapes_coco": spec_of_shapes_coco}


def check_generated(cfg) -> None:
    """Check that a built-in data set can be generated into, or read from, its `data.root`.

    Before any rank starts: a ValueError naming the fix where `data.root` holds something the
    built-in set of `cfg` (a data config) cannot be generated into or read from (another spec's
    copy, other files).

    Args:
        cfg: the data config; a set that is not built-in (no `data.synthetic`) passes.
    """
    if cfg.synthetic is None or cfg.name not in SPECS:
        return
    problem = conflict(Path(cfg.root).expanduser(), SPECS[cfg.name](cfg.synthetic))
    if problem:
        raise ValueError(problem)


def prepare_data(cfg, show_progress: bool = False) -> None:
    """Generate a built-in dataset if it is missing. Call on one rank per node, then barrier.

    Args:
        cfg: the data config; nothing is done without `data.synthetic`.
        show_progress: a progress bar while the images are written.
    """
    if cfg.synthetic is None:
        return
    if cfg.name not in GENERATORS:
        raise ValueError(
            f"data.synthetic is set but there is no built-in dataset named {cfg.name!r}"
        )
    GENERATORS[cfg.name](cfg.root, cfg.synthetic, show_progress=show_progress)
