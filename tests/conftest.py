import os
import sys
from pathlib import Path

import pytest

# one thread per test process (pytest_configure), for every library that
if os.environ.get("PYTEST_XDIST_WORKER"):
    # reads it as it loads (OpenMP, OpenBLAS, OpenCV) and for in-process ranks
    os.environ["OMP_NUM_THREADS"] = "1"

# every Python process a test starts prints its threads' stacks on SIGABRT, which a job past its
# timeout is sent before it is killed (helpers.finish_job): a hang then says where it was
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

import visiondist  # noqa: F401 (first, as in every tool: the test processes' OpenMP waiting chosen as there, see procenv)

HERE = Path(__file__).resolve().parent
# the helpers; the rank-side modules the multi-rank tests import
sys.path[:0] = [str(HERE), str(HERE / "multirank")]

from helpers import TINY_DATA  # noqa: E402


def pytest_configure(config):
    """One thread per test process under xdist, as the rank processes the tests start have
    (OMP_NUM_THREADS=1 in helpers.env): two workers on two cores that each run torch's default
    thread pool, beside a multi-rank test's ranks, oversubscribe the cores, and torch's OpenMP
    threads then spin at every barrier: a 5 s model test took over 300 s that way.

    The project's modules are compiled to bytecode once, first: the suite starts over a thousand
    Python processes (launchers, ranks, tools), and where PYTHONDONTWRITEBYTECODE is set (as in many
    containers) each one compiled visiondist's sources anew, about 1.2 s of CPU a process."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        import compileall

        for folder in ("visiondist", "tools", "tests", "benchmarks"):
            compileall.compile_dir(str(HERE.parent / folder), quiet=1, workers=1)
    else:
        import torch

        torch.set_num_threads(1)
    # each test process adopts what a launcher leaves behind
    if os.environ.get("VISIONDIST_TEST_CPU"):
        import ctypes

        ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


@pytest.fixture(scope="session")
def tiny_shapes(tmp_path_factory) -> Path:
    """A small generated shapes dataset, shared by the tests of one session."""
    from types import SimpleNamespace

    from visiondist.synthetic.shapes import ensure_shapes

    overrides = dict(a.split("=", 1) for a in TINY_DATA if a.startswith("data.synthetic."))
    synthetic = SimpleNamespace(
        train_per_class=int(overrides["data.synthetic.train_per_class"]),
        val_per_class=int(overrides["data.synthetic.val_per_class"]),
        image_size=int(overrides["data.synthetic.image_size"]),
        seed=0,
    )
    return ensure_shapes(tmp_path_factory.mktemp("data") / "shapes", synthetic)


@pytest.fixture(scope="session")
def shapes_coco(tmp_path_factory):
    """A generated COCO-format set of 23 val images, shared by the COCO evaluation tests."""
    from types import SimpleNamespace

    from visiondist.synthetic.shapes_coco import ensure_shapes_coco

    # 23: no even split over 2 or 3
    spec = SimpleNamespace(train_images=8, val_images=23, image_size=64, seed=0)
    return ensure_shapes_coco(tmp_path_factory.mktemp("data") / "shapes_coco", spec)


@pytest.fixture(scope="session")
def single_process(shapes_coco):
    """The reference: one process's detections of the stand-in detector on `shapes_coco`, scored by
    pycocotools."""
    import coco_ranks  # tests/multirank/, on the path (above)

    from visiondist.evaluation.coco_scoring import score
    from visiondist.evaluation.detection import deduplicate, predict

    data = coco_ranks.val_set(shapes_coco)
    detections, seen, _ = predict(
        coco_ranks.StandInDetector(data), coco_ranks.loader(data, 0, 1), "cpu", data.cat_of
    )
    dets, count, _ = deduplicate([(detections, seen)], expected=len(data))
    assert count == 23 and len(dets) > 23
    return dets, score(data.ann_file, dets, backend="pycocotools"), data


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With VISIONDIST_TEST_CPU=<file>: each test's CPU seconds (its setup and teardown included),
    of the test process and of every process it started and waited for (launchers, their ranks and
    loader workers), appended to the file as `cpu wall node id`. Under xdist the wall time of
    `--durations` counts time a test waits beside another; the CPU is what the suite's time on a
    machine of few cores is made of. The test process adopts the processes whose parent ended first
    (a fork server outlives its launcher) and collects them at the test's end, so that their CPU is
    counted: a measurement mode, not for a run whose results matter."""
    path = os.environ.get("VISIONDIST_TEST_CPU")
    if not path:
        yield
        return
    import time

    def cpu(settle: float) -> float:
        time.sleep(settle)  # a fork server ends just after its launcher
        while True:  # the adopted processes that have ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        t = os.times()
        from prepared import PREPARED_CPU  # the runs the prepared interpreter forked

        return t.user + t.system + t.children_user + t.children_system + PREPARED_CPU[0]

    start, wall = cpu(0.0), time.monotonic()
    yield
    with open(path, "a") as f:
        f.write(f"{cpu(0.3) - start:8.1f} {time.monotonic() - wall:8.1f} {item.nodeid}\n")
