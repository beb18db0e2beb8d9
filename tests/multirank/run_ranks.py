"""Child process of `helpers.spawn_ranks`: run `module.function` on N gloo ranks (torch's elastic
launcher) and pickle every rank's return value, or each failing rank's error, to a file.

    python tests/multirank/run_ranks.py <module> <function> <nprocs> <args.pkl> <result.pkl>
"""

import importlib
import os
import pickle
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the rank-side modules beside it, the helpers (and test modules) above
sys.path[:0] = [str(HERE), str(HERE.parent)]


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from visiondist.launch import spawn_local

    module, function, nprocs, args_file, result_file = sys.argv[1:]
    fn = getattr(importlib.import_module(module), function)
    args, kwargs = pickle.loads(Path(args_file).read_bytes())
    try:
        # ranks on the CPU are forked, from this process or a fork server, as the product's are
        # (launch.spawn)
        cuda = os.environ.get("VISIONDIST_TEST_DEVICE", "cpu") != "cpu"
        result = {"ok": spawn_local(fn, int(nprocs), *args, cuda=cuda, **kwargs)}
    except ChildFailedError as exc:
        failures = {}
        for rank, f in exc.failures.items():
            data = (
                f.error_file_data.get("message", {}) if isinstance(f.error_file_data, dict) else {}
            )
            stack = (
                data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""
            )
            failures[rank] = f"exit code {f.exitcode}: {f.message}\n{stack}"
        result = {"failures": failures, "text": str(exc)}
    Path(result_file).write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    main()
