"""visiondist.utils.exit: a finished process leaves without the interpreter's teardown, after its
atexit handlers and with its output flushed; one that failed leaves as usual, with its exit code."""

import subprocess
import sys
import textwrap

from helpers import REPO

SCRIPT = textwrap.dedent("""
    import atexit, logging, multiprocessing as mp, sys
    from visiondist.utils.exit import exit_now, leave_quickly_when_done

    class Teardown:  # its __del__ runs when the interpreter tears the module down
        def __init__(self, path, who):
            self.path, self.who = path, who

        # its own `open`: the teardown may have cleared the builtins by then
        def __del__(self, open=open):
            open(self.path, "a").write(f"{self.who} torn down\\n")

    def rank(path, succeed):
        global kept
        kept = Teardown(path, "succeeding rank" if succeed else "failing rank")
        done = leave_quickly_when_done()
        atexit.register(lambda: open(path, "a").write("rank handler ran\\n"))
        if not succeed:
            raise RuntimeError("the rank failed")
        done()

    if __name__ == "__main__":
        path = sys.argv[1]
        tool = Teardown(path, "tool")
        codes = []
        for succeed in (True, False):
            p = mp.get_context("spawn").Process(target=rank, args=(path, succeed))
            p.start()
            p.join()
            codes.append(p.exitcode)
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
        logging.info("logged %s", codes)
        atexit.register(lambda: open(path, "a").write("tool handler ran\\n"))
        sys.stdout.write("no newline at the end")  # still in the buffer: exit_now flushes it
        exit_now(3)
""")


def test_exit_now_runs_the_handlers_flushes_and_keeps_the_code(tmp_path):
    script, record = tmp_path / "tool.py", tmp_path / "record.txt"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(record)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 3, out.stderr
    # the succeeding rank left with 0 after its handler and without the teardown; the failing one
    # with 1, its traceback printed, torn down as usual; the tool after its handler, without the
    # teardown
    assert out.stdout.splitlines() == ["logged [0, 1]", "no newline at the end"]
    assert "RuntimeError: the rank failed" in out.stderr
    assert record.read_text().splitlines() == [
        "rank handler ran",
        "rank handler ran",
        "failing rank torn down",
        "tool handler ran",
    ]
