import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import TINY_DATA  # noqa: E402


@pytest.fixture(scope="session")
def tiny_shapes(tmp_path_factory) -> Path:
    """A small generated shapes dataset, shared by the tests of one session."""
    from types import SimpleNamespace

    from visiondist.data.builtin import ensure_shapes

    overrides = dict(a.split("=", 1) for a in TINY_DATA if a.startswith("data.synthetic."))
    synthetic = SimpleNamespace(
        train_per_class=int(overrides["data.synthetic.train_per_class"]),
        val_per_class=int(overrides["data.synthetic.val_per_class"]),
        image_size=int(overrides["data.synthetic.image_size"]),
        seed=0,
    )
    return ensure_shapes(tmp_path_factory.mktemp("data") / "shapes", synthetic)
