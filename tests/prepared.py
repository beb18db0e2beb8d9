"""A prepared interpreter: `python tests/prepared.py <socket>` imports what the tools import (torch, torchvision, the
trainer, the evaluation, Hydra, ...) once, then forks one child per tool run a test asks for (helpers.run_cli), which
runs the tool's script as `python <script> <args>` would, with the test's command line, environment, working directory
and output pipe.

Why: a tool run spends about 5 s of CPU importing before it does anything (torch alone ~3 s), and the suite runs
about 250 of them on 2 cores. What a forked run does not show, a fresh interpreter's imports, the tests that start
real processes do (every test that kills, signals or inspects a job's processes starts it with helpers.start_job;
`VISIONDIST_TEST_FRESH=1` runs every tool run in a fresh interpreter; CI's torch 2.11 smoke subset runs that way).

Protocol, one Unix-socket connection per run: the client sends an 8-byte length and a JSON request
{"argv", "env", "cwd"} with the write end of its output pipe; the server answers the run's pid on a line, and when the
run has ended, its exit code (negative: the signal that ended it) and its CPU seconds (with the processes it waited
for: its ranks), on a second line. Each run is its own session, so that a test's timeout can kill its process group.
The server leaves when its parent (the test process) has gone."""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import threading

# Besides every visiondist module (visiondist first: its process defaults before torch), what the tools import from
# other libraries when they need them: Hydra's machinery, the DETR-class models, timm, the ONNX exporter.
LIBRARIES = (
    "torch", "torchvision", "hydra", "hydra._internal.utils", "omegaconf", "torch.distributed.launcher.api",
    "torch.distributed.checkpoint", "torch.utils.tensorboard", "safetensors.torch", "matplotlib.figure",
    "matplotlib.backends.backend_agg", "albumentations", "scipy.optimize", "pycocotools.coco", "timm",
    "transformers.models.rt_detr_v2.modeling_rt_detr_v2", "transformers.models.d_fine.modeling_d_fine",
    "onnx", "onnxscript", "onnxruntime", "torch.onnx",
)


def _preload() -> None:
    import pkgutil

    import visiondist

    names = [m.name for m in pkgutil.walk_packages(visiondist.__path__, "visiondist.")]
    for name in (*LIBRARIES, *names):
        try:
            importlib.import_module(name)
        except ImportError:  # an extra this environment does not have: a run that needs it imports it (and fails)
            pass
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert not threads, f"the prepared interpreter must fork with one thread; started by its imports: {threads}"


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
    """In the forked child: become `python <argv>` (or `python -m <module> ...`) and never return."""
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
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    os._exit(code)


def _finish() -> None:
    """The interpreter's own ending: non-daemon threads joined, atexit handlers run, streams flushed."""
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
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime:.3f}\n"
                                 .encode())
                except OSError:
                    pass
                conn.close()
    for pid in runs:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1])
