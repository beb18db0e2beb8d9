"""examples/python_api.ipynb executed as a user runs it: in a Jupyter kernel (ipykernel) driven by
nbclient, Jupyter's own client. A callback class defined in the notebook counts its calls on each
of 2 ranks started from the kernel; evaluate, predict (a drawn image shown inline), export ONNX run
by ONNX Runtime; a misspelt model is one ConfigError line; the kernel trains a second time. And
the kernel's stop button during a run, then ten runs in one kernel (jupyter_client, the client
Jupyter's front ends use)."""

import ast
import queue
import time
from pathlib import Path

import jupyter_client
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
    # one progress bar: a widget updated in place, drawn by the kernel from rank 0's feed
    widgets = [
        o
        for o in cells[1].outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert len(widgets) == 1, cells[1].outputs
    state = notebook.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    bar = state[widgets[0].data["application/vnd.jupyter.widget-view+json"]["model_id"]]
    assert "6/6" in bar["state"]["outputs"][-1]["data"]["text/plain"]
    assert "val top-1 " in _text(cells[2])
    shown = [o for o in cells[3].outputs if o.output_type == "execute_result"]
    assert shown and shown[0].data["image/png"]  # the drawn image, inline
    assert "ONNX Runtime vs PyTorch" in _text(cells[4]) and "model.onnx (2, 6)" in _text(cells[4])
    error = _text(cells[5]).strip()
    assert error.startswith("ConfigError: model=vit_tinny is not an option of model: did you mean")
    assert "\n" not in error
    assert _text(cells[6]).strip().splitlines()[-1].startswith("Run(")
    assert len(list((tmp_path / "outputs").glob("*/*/summary.json"))) == 2


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _execute(manager, client, code: str, interrupt_when: str = "", timeout: float = 120) -> str:
    """Run `code` in the kernel and return its output; interrupt the kernel (as Jupyter's stop
    button does) once the output holds `interrupt_when`."""
    msg_id, out, start, sent = client.execute(code), [], time.monotonic(), False
    while time.monotonic() - start < timeout:
        if interrupt_when and not sent and interrupt_when in "".join(out):
            manager.interrupt_kernel()
            sent = True
        try:
            msg = client.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            out.append(f"{content['ename']}: {content['evalue']}\n")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)
    raise TimeoutError(f"the kernel did not finish: {''.join(out)[-2000:]}")


def test_interrupting_the_kernel_stops_the_ranks_and_ten_runs_leave_nothing(tmp_path):
    """The kernel's stop button (SIGINT) during a 2-rank run: every rank finishes its step and
    writes a checkpoint, the call returns the stopped Run; then ten more runs of 2 ranks in the
    same kernel, after which no process is left under the kernel."""
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        _execute(manager, client, f"import visiondist\nSETTINGS = {SETTINGS!r}")
        said = _execute(
            manager,
            client,
            'run = visiondist.train("model=vit_tiny", "model.depth=2", **SETTINGS)\n'
            "print(repr(run), [p.name for p in run.checkpoints])",
            interrupt_when="training: step 1/",
        )
        assert "SIGINT: the ranks finish their step and write a checkpoint" in said, said
        last = said.strip().splitlines()[-1]
        assert ", stopped at step " in last and "'step_" in last, said
        runs = _execute(
            manager,
            client,
            "short = {**SETTINGS, 'trainer': {**SETTINGS['trainer'], 'max_steps': 1}}\n"
            "done = [visiondist.train('model=vit_tiny', 'model.depth=2', **short).complete\n"
            "        for _ in range(10)]\n"
            "print(done)",
        )
        assert runs.strip().splitlines()[-1] == str([True] * 10), runs
        pid = manager.provisioner.process.pid
        assert _descendants(pid) == [], _descendants(pid)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


SETTINGS = {
    "data": {
        "root": "data/shapes_small",
        "synthetic": {"train_per_class": 16, "val_per_class": 5, "image_size": 32},
        "img_size": 32,
        "batch_size": 16,
    },
    "trainer": {
        "max_steps": 100000,
        "max_epochs": 0,
        "eval_every": 0,
        "devices": 2,
        "accelerator": "cpu",
        "output_dir": "outputs",
        "progress": False,
        "plots": False,
        "loggers": ["csv"],
    },
}
