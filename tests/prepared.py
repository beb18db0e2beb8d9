"""A prepared interpreter, both ends: the server, `python tests/prepared.py <socket>`, imports what
the tools import (torch, torchvision, the trainer, the evaluation, Hydra, ...) once, then forks one
child per tool run a test asks for, which runs the tool's script as `python <script> <args>` would,
with the test's command line, environment, working directory and output pipe, in its own session;
the client (`prepared_for`, `PreparedRun`) is what helpers.start_job uses for a `python <script>` or
`python -m <module>` run.

Why: a tool run spends about 5 s of CPU importing before it does anything (torch alone ~3 s), and
the suite runs about 250 of them on 2 cores. A forked run has the same process tree, signals and
exit codes as a fresh one (tests/multirank/test_prepared.py); what it does not show is a fresh
interpreter's imports and start-up. Those are shown by the runs that start fresh: the tests whose
subject is a process's start (start_job(fresh=True)), runs whose environment differs where start-up
reads it (`_READ_AT_START`), every run under `VISIONDIST_TEST_FRESH=1`, which CI's torch 2.11
smoke subset sets, and every run on a GPU test device (tests/devices.py).

Protocol, one Unix-socket connection per run: the client sends an 8-byte length and a JSON request
{"argv", "env", "cwd"} with the write end of its output pipe; the server answers the run's pid on a
line, and when the run has ended, its exit code (negative: the signal that ended it) and its CPU
seconds (with the processes it waited for: its ranks), on a second line. Each run is its own
session, so that a test's timeout can kill its process group. The server leaves when its parent (the
test process) has gone."""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

# Besides every visiondist module (visiondist first: its process defaults before torch), what the
# tools import from other libraries when they need them: Hydra's machinery, the DETR-class models,
# timm, the ONNX exporter.
LIBRARIES = (
    "torch",
    "torchvision",
    "hydra",
    "hydra._internal.utils",
    "omegaconf",
    "torch.distributed.launcher.api",
    "torch.distributed.checkpoint",
    "torch.utils.tensorboard",
    "safetensors.torch",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "albumentations",
    "scipy.optimize",
    "pycocotools.coco",
    "timm",
    "transformers.models.rt_detr_v2.modeling_rt_detr_v2",
    "transformers.models.d_fine.modeling_d_fine",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "torch.onnx",
)


def _preload() -> None:
    import pkgutil

    import visiondist

    names = [m.name for m in pkgutil.walk_packages(visiondist.__path__, "visiondist.")]
    for name in (*LIBRARIES, *names):
        try:
            importlib.import_module(name)
        # an extra this environment does not have: a run that needs it imports it (and fails)
        except ImportError:
            pass
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert not threads, (
        f"the prepared interpreter must fork with one thread; started by its imports: {threads}"
    )


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 1)
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("the client closed the connection mid-request")
        body += chunk
    return json.loads(body), fds


def _run(request: dict, out: int) -> None:
    """In the forked child: become `python <argv>` (or `python -m <module> ...`) and never
    return."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import runpy

        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = request["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [script, *argv[1:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as the interpreter ends: its traceback, then by SIGINT itself
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _finish() -> None:
    """The interpreter's own ending: non-daemon threads joined, atexit handlers run, streams
    flushed."""
    import atexit

    try:
        threading._shutdown()
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def serve(path: str) -> None:
    parent = os.getppid()
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(32)
    print("ready", flush=True)
    runs: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _run(request, fds[0])
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:
                pass
            runs[pid] = conn
        while runs:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = runs.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(
                        f"{os.waitstatus_to_exitcode(status)} "
                        f"{usage.ru_utime + usage.ru_stime:.3f}\n".encode()
                    )
                except OSError:
                    pass
                conn.close()
    for pid in runs:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


# Variables read when torch, OpenMP, Python or a library start: a run whose environment differs from
# the prepared interpreter's in one of these starts a fresh interpreter (TORCHINDUCTOR_CACHE_DIR:
# read where it is used).
_READ_AT_START = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NCCL",
    "PYTHON",
    "LD_",
    "MALLOC",
    "NO_ALBUMENTATIONS",
    "VISIONDIST_OMP_WAIT",
    "TRITON",
    "INDUCTOR",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TIMM",
    "XDG_",
    "HOME",
    "MPL",
    "TMPDIR",
)
_READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)
_server: dict = {}
# CPU seconds of the runs forked by this process's prepared interpreter (measurement mode)
PREPARED_CPU = [0.0]


def _at_start(env: dict) -> dict:
    return {
        n: v for n, v in env.items() if n.startswith(_READ_AT_START) and n not in _READ_WHEN_USED
    }


def prepared_for(command: list[str], env: dict, own: dict) -> bool:
    """Whether a run of `command` (after `python`) with `env` can be forked from the prepared
    interpreter: a script, or `-m` and a module, with the environment the interpreter started under
    as far as start-up reads it. The interpreter starts under `own` (the environment of this test
    process's jobs) on first use, and again where that has changed since (a test that called the
    launcher in this process)."""
    if (
        os.environ.get("VISIONDIST_TEST_FRESH")
        # the ranks on a GPU (tests/devices.py): a child forked from an interpreter whose imports
        # touched CUDA cannot initialise it ("Cannot re-initialize CUDA in forked subprocess")
        or os.environ.get("VISIONDIST_TEST_DEVICE", "cpu") != "cpu"
        or not (command[0] == "-m" or not command[0].startswith("-"))
    ):
        return False
    wanted = _at_start(env)
    if _server and _server["at_start"] != wanted and wanted == _at_start(own):
        _server.clear()  # the old one ends with this process, once the runs it forked have ended
    return _prepared(own)["at_start"] == wanted


def _prepared(env: dict) -> dict:
    """This test process's prepared interpreter, started under `env` on first use; it ends when this
    process does."""
    if not _server:
        import atexit
        import tempfile

        folder = tempfile.mkdtemp(prefix="vd-prep-")
        path = os.path.join(folder, "s")
        # its imports' warnings, not in the test's output
        log = open(os.path.join(folder, "log"), "w+")
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        line = proc.stdout.readline()
        log.seek(0)
        assert line.strip() == "ready", (
            f"the prepared interpreter did not start: {line!r}\n{log.read()[-3000:]}"
        )
        atexit.register(_end_prepared, proc, folder)
        _server.update(path=path, at_start=_at_start(env), proc=proc)
    return _server


def _end_prepared(proc: subprocess.Popen, folder: str) -> None:
    import shutil

    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


class PreparedRun:
    """A tool run forked by the prepared interpreter (after `prepared_for` said it can be), with the
    part of `subprocess.Popen`'s interface the helpers use: `pid` (also its process group), `args`,
    `returncode`, `poll`, `wait`, `communicate` (output and errors in one text)."""

    def __init__(self, command: list[str], env: dict, cwd):
        self.args, self.returncode, self._chunks = [sys.executable, *command], None, []
        read, write = os.pipe()
        self._out = read
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server["path"])
        body = json.dumps({"argv": command, "env": env, "cwd": str(cwd)}).encode()
        socket.send_fds(self._conn, [len(body).to_bytes(8, "big")], [write])
        self._conn.sendall(body)
        os.close(write)
        self._lines = self._conn.makefile("r")
        self.pid = int(self._lines.readline())

    def _status(self, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
            line = self._lines.readline()
            assert line, f"the prepared interpreter ended before run {self.pid} did"
            code, cpu = line.split()
            self.returncode = int(code)
            PREPARED_CPU[0] += float(cpu)
            self._conn.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._status(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._out is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._out], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = os.read(self._out, 1 << 16)
            if chunk:
                self._chunks.append(chunk)
            else:
                os.close(self._out)
                self._out = None
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        text = b"".join(self._chunks).decode(errors="replace")
        return text.replace("\r\n", "\n").replace("\r", "\n"), None


if __name__ == "__main__":
    serve(sys.argv[1])
