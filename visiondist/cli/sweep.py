"""Multirun (`tools/train.py -m optim.lr=1e-3,3e-4 ...`): Hydra's sweep syntax expanded into jobs
that run one after another, each launching its own ranks, each in its own run directory `<sweep
dir>/<job number>`.

Every job's config is composed and validated before the first job starts, so a typo in the third
value fails in seconds, not after two trainings. The sweep directory holds `sweep.json` (each job's
overrides, run dir, status and headline results, rewritten after every job) and the end prints one
table of the jobs. A job that fails is recorded (`failed (exit N)` and its one-line cause) and the
next one runs; the sweep then exits non-zero. A stop signal (SIGTERM, Ctrl-C) ends the whole sweep.
Jobs are numbered from 0 everywhere: banner, run directories, table.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence, Union, cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from visiondist.cli.load import load_config
from visiondist.config import ConfigError
from visiondist.launch import unique_dir
from visiondist.plan.world import under_torchrun

# summary.json keys shown in the sweep table, when the jobs have them
RESULT_KEYS = (
    "final train loss",
    "val top-1 (%)",
    "val top-5 (%)",
    "val box mAP@[.5:.95]",
    "val AP50",
    "throughput (img/s)",
)


def expand(overrides: list[str]) -> tuple[list[list[str]], list[str]]:
    """(one override list per job, the swept keys), in Hydra's order: the cartesian product of the
    swept values, the last key varying fastest."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        options, swept = [], []
        for override in parsed:
            if override.is_sweep_override():
                key = override.get_key_element()
                options.append([f"{key}={value}" for value in override.sweep_string_iterator()])
                swept.append(key)
            elif override.input_line is None:  # parsed from the command line: it has its text
                raise ConfigError(f"-m: {override.get_key_element()}: an override without its text")
            else:
                options.append([override.input_line])
    except HydraException as exc:
        raise ConfigError(
            f"-m: {str(exc).splitlines()[0]} (sweeps take comma-separated values or range(a,b))"
        ) from exc
    return [list(job) for job in itertools.product(*options)], swept


def _checked_configs(
    config_dir: Path, jobs: list[list[str]], search: Sequence[str], shown: bool
) -> list[DictConfig]:
    """Every job's config, composed and checked before any job runs (a bad one names its job)."""
    configs = []
    for num, job in enumerate(jobs):
        try:
            configs.append(
                load_config(config_dir, [*job, *search], inputs=None if shown else "train")
            )
        except ConfigError as exc:
            raise ConfigError(f"job {num} ({' '.join(job)}): {exc}") from exc
    return configs


def run_sweep(
    tool: str,
    config_dir: Path,
    overrides: list[str],
    run: Callable[[DictConfig], object],
    show: Union[bool, Callable[[DictConfig], str], None] = False,
    search: Sequence[str] = (),
) -> int:
    """Every job's config checked, then each job run in turn; `show` (--cfg: True or the printer):
    print each job's config instead. `search`: the overrides adding -cd's directory, for every job
    (not shown in its overrides). `trainer.run_dir` (hydra.sweep.dir) is the sweep's directory."""
    if under_torchrun(os.environ):
        raise ConfigError(
            "-m runs its jobs one after another, each launching its own ranks: under torchrun, "
            "start one torchrun per job instead"
        )
    jobs, swept = expand(overrides)
    run_dir = next(
        (
            o.split("=", 1)[1]
            for o in overrides
            if o.split("=", 1)[0].lstrip("+") == "trainer.run_dir"
        ),
        None,
    )
    jobs = [[o for o in job if o.split("=", 1)[0].lstrip("+") != "trainer.run_dir"] for job in jobs]
    configs = _checked_configs(config_dir, jobs, search, bool(show))
    if show:
        for num, (job, cfg) in enumerate(zip(jobs, configs)):
            text = show(cfg) if callable(show) else OmegaConf.to_yaml(cfg)
            print(f"# job {num}: {' '.join(job)}\n{text}")
        return 0
    if run_dir is not None:  # the sweep directory; its jobs' run dirs are numbered inside it
        sweep_dir = Path(run_dir).expanduser()
        sweep_dir.mkdir(parents=True, exist_ok=True)
    else:
        sweep_dir = unique_dir(Path(configs[0].trainer.output_dir).expanduser() / "multirun")
    console = Console(width=max(100, Console().width))
    records, codes = [], []
    for num, (job, cfg) in enumerate(zip(jobs, configs)):
        job_dir = sweep_dir / str(num)
        # the job's config, a new object
        cfg = cast(DictConfig, OmegaConf.merge(cfg, {"trainer": {"run_dir": str(job_dir)}}))
        records.append({"job": num, "overrides": job, "run_dir": str(job_dir), "status": "running"})
        _write(sweep_dir, swept, records)
        console.rule(
            f"[bold]{tool} job {num} ({num + 1} of {len(jobs)}): "
            f"{' '.join(job) or '(no overrides)'}"
        )
        code, cause = _run_job(run, cfg)
        codes.append(code)
        records[-1]["status"] = (
            "done" if code == 0 else f"{'stopped' if code in _STOPPED else 'failed'} (exit {code})"
        )
        if cause:
            print(f"job {num} failed: {cause}", file=sys.stderr, flush=True)
            records[-1]["error"] = cause
        records[-1].update(_results(job_dir))
        _write(sweep_dir, swept, records)
        if code in _STOPPED:  # the user stopped the job: stop the sweep, not just this job
            break
    console.print(_table(sweep_dir, swept, records, len(jobs)))
    failed = [r for r in records if r.get("error")]
    if failed:  # unwrapped, after the table: the causes and where their tracebacks are
        print(f"{len(failed)} of {len(jobs)} jobs failed:", file=sys.stderr)
        for r in failed:
            print(f"  job {r['job']}: {r['error']}", file=sys.stderr, flush=True)
    return next((c for c in codes if c), 0)  # the first failed job's exit code


_STOPPED = (128 + 2, 128 + 15)  # SIGINT, SIGTERM: what tools/train.py returns for a stopped job


def _run_job(run: Callable[[DictConfig], object], cfg: DictConfig) -> tuple[int, str]:
    """(exit code, one-line cause or "") of one job."""
    try:
        result = run(cfg)
    except Exception as exc:
        # a stop signal: its line says what the job kept; the sweep ends
        if type(exc).__name__ == "JobStopped":
            print(exc, file=sys.stderr, flush=True)
            # told apart by name: this module does not import the launcher's exceptions
            return exc.exit_code, ""  # type: ignore[attr-defined]
        return 1, _cause(exc)
    return (result if isinstance(result, int) else 0), ""


def _cause(exc: Exception) -> str:
    """One line: a failed job's own line (`launch.RunFailed`: rank, step, cause, traceback file),
    else the exception."""
    text = str(exc) if type(exc).__name__ == "RunFailed" else f"{type(exc).__name__}: {exc}"
    return text.strip().splitlines()[0]


def _results(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    return {key: summary[key] for key in RESULT_KEYS if summary.get(key) is not None}


def _write(sweep_dir: Path, swept: list[str], records: list[dict]) -> None:
    tmp = sweep_dir / "sweep.json.tmp"
    tmp.write_text(json.dumps({"swept": swept, "jobs": records}, indent=1))
    tmp.replace(sweep_dir / "sweep.json")


def _table(sweep_dir: Path, swept: list[str], records: list[dict], total: int):
    keys = [k for k in RESULT_KEYS if any(k in r for r in records)]
    table = Table(
        title=f"sweep: {len(records)} of {total} jobs in {sweep_dir}", title_justify="left"
    )
    for column in ("job", *swept, "status", *keys):
        table.add_column(column)
    for r in records:
        values = dict(o.split("=", 1) for o in r["overrides"])
        status = r["status"]
        table.add_row(
            str(r["job"]),
            *(values.get(k, "") for k in swept),
            status,
            *(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys),
        )
    return table
