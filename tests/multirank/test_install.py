"""The plain install (`pip install -e .`, no extra) trains the default run: tools/train.py runs with
every package outside the project's required dependencies (and theirs) made unimportable (Ray,
MLflow, W&B, moto, the Kubeflow models, transformers, ONNX, torchao, boto3, ...), as a machine with
only the plain install has them."""

import importlib.metadata as metadata
import re
import sys

import pytest
from helpers import REPO, finish_job, job_env, start_job

# install tools every environment has (site and torch may import them); never blocked
_TOOLING = {"pip", "setuptools", "pkg_resources", "_distutils_hack", "wheel"}


# sitecustomize.py of the job: every finder wrapped so that it finds none of the blocked packages,
# as if they were not installed (an import raises ModuleNotFoundError, importlib.util.find_spec
# returns None, as torch's probes expect)
BLOCKER = """\
import sys

BLOCKED = set(NAMES)


class NotInstalled:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [NotInstalled(finder) for finder in sys.meta_path]
"""


def _plain_install() -> set[str]:
    """The distributions `pip install -e .` brings: visiondist's required dependencies and theirs,
    no extra."""
    from packaging.requirements import Requirement

    seen, todo = set(), ["visiondist"]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _blocked() -> set[str]:
    """The top-level modules of every installed distribution outside the plain install."""
    plain = _plain_install()
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if (
            not any(re.sub(r"[-_.]+", "-", d).lower() in plain for d in dists)
            and module not in _TOOLING
        ):
            blocked.add(module)
    return blocked


# README's figure for the default run (`python tools/train.py`): the range measured over seeds,
# thread counts and machines (benchmarks/RESULTS.md, "The default run's accuracy")
DEFAULT_TOP1 = (56.0, 60.0)


# the whole default run, 3 epochs (about 140 s on one thread beside another test)
@pytest.mark.timeout(660)
def test_the_plain_install_trains_the_default_run(tmp_path):
    """README's main job as a new user runs it, `python tools/train.py` with nothing but the data's
    place and the run dir, under the plain install: it trains its 3 epochs and ends inside README's
    stated top-1 range."""
    blocked = _blocked()
    # the extras of `.[dev]`
    assert {"ray", "mlflow", "wandb", "moto", "transformers", "onnx"} <= blocked
    # required, or theirs
    assert {"torch", "timm", "albumentations", "tensorboard", "scipy"}.isdisjoint(blocked)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.replace("NAMES", repr(sorted(blocked))))
    env = job_env(PYTHONPATH=str(site))
    probe = finish_job(start_job([sys.executable, "-c", "import wandb"], env), 60, "import wandb")
    assert "ModuleNotFoundError: No module named 'wandb'" in probe, probe
    run = tmp_path / "run"
    proc = start_job(
        [
            sys.executable,
            str(REPO / "tools" / "train.py"),
            f"data.root={tmp_path / 'shapes'}",
            # what the tool imports is the subject
            f"trainer.run_dir={run}",
        ],
        env,
        fresh=True,
    )
    out = finish_job(proc, 600, "the default run under the plain install")
    assert proc.returncode == 0, out[-4000:]
    assert (run / "model.safetensors").is_file() and (run / "curves.png").is_file(), out[-3000:]
    top1 = float(re.search(r"^val top-1: ([\d.]+)%$", out, re.M)[1])
    assert DEFAULT_TOP1[0] <= top1 <= DEFAULT_TOP1[1], (top1, out[-3000:])
    # what it states
    assert f"{DEFAULT_TOP1[0]:g}-{DEFAULT_TOP1[1]:g}% top-1" in (REPO / "README.md").read_text()
