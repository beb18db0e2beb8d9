"""examples/python_api.ipynb executed as a user runs it: in a Jupyter kernel (ipykernel) driven by
nbclient, Jupyter's own client. A callback class defined in the notebook counts its calls on each
of 2 ranks started from the kernel; evaluate, predict (a drawn image shown inline), export ONNX run
by ONNX Runtime; a misspelt model is one ConfigError line; the kernel trains a second time."""

import ast

import nbclient
import nbformat
from helpers import REPO


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_the_python_api_notebook_runs_end_to_end(tmp_path):
    notebook = nbformat.read(REPO / "examples" / "python_api.ipynb", as_version=4)
    # the notebook's folder is where a user opened it: outputs/ and data/ go there
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]

    trained = _text(cells[1]).strip().splitlines()
    assert trained[-2].startswith("Run(") and ", complete, val_loss=" in trained[-2]
    counts = ast.literal_eval(trained[-1])  # each rank's copy of the notebook's callback
    assert counts == {r: {"on_step_end": 6, "on_eval_end": 2} for r in (0, 1)}, counts
    assert "val top-1 " in _text(cells[2])
    shown = [o for o in cells[3].outputs if o.output_type == "execute_result"]
    assert shown and shown[0].data["image/png"]  # the drawn image, inline
    assert "ONNX Runtime vs PyTorch" in _text(cells[4]) and "model.onnx (2, 6)" in _text(cells[4])
    error = _text(cells[5]).strip()
    assert error.startswith("ConfigError: model=vit_tinny is not an option of model: did you mean")
    assert "\n" not in error
    assert _text(cells[6]).strip().splitlines()[-1].startswith("Run(")
    assert len(list((tmp_path / "outputs").glob("*/*/summary.json"))) == 2
