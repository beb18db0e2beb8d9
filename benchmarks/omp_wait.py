"""Training beside a busy process: OpenMP's waiting threads spinning (torch's default), sleeping
(`OMP_WAIT_POLICY=PASSIVE`), or as visiondist chooses (`visiondist.utils.procenv`: passive where the
process's CPUs are shared as it starts, torch's default where they are idle).

Each cell is a fresh process (OpenMP reads its policy once, when torch loads it), on an idle CPU and
beside one spinning process (a busy neighbour, started first), with each policy:
- "default": torch's default (the step: the process imports torch only; the run:
  `GOMP_SPINCOUNT=300000`, libgomp's own count when no policy is set, named so that visiondist keeps
  it);
- "passive": `OMP_WAIT_POLICY=PASSIVE` in its environment;
- "visiondist": nothing set; the process imports visiondist first, as every tool and rank does, and
  it chooses.

Workloads (`--workload`): "step" trains timm's ViT-Ti/16 at 64 px, batch 64 (forward + backward +
AdamW, torch's default threads) for at least `--seconds` after two warm-up steps; "run" is the
README's default run (`tools/train.py`, built-in shapes data with its loader workers) for `--steps`
steps, its steady-state rate from summary.json. The cells run in turn, the order reversed every
other round; the table gives each cell's median img/s and the ratios that matter: visiondist's
choice against the faster fixed policy in each load (goal: on the idle CPU within 2% of torch's
default), busy / idle per policy (goal: within 2x). "Others" is the CPU time other processes of the
machine (not this benchmark's) used during the cells, in CPUs: on a shared machine "idle" is only as
idle as that says; each cell waits (up to --quiet-wait seconds) for them to use less than
--quiet-below CPUs first.

    python benchmarks/omp_wait.py                          # the step, 3 rounds
    python benchmarks/omp_wait.py --workload run --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("default", "passive", "visiondist")
CELLS = tuple((load, policy) for load in ("idle", "busy") for policy in POLICIES)
HEADS = {"idle": "idle CPU", "busy": "beside one busy process"}
CHOSEN = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "VISIONDIST_OMP_WAIT")


def _step_rate(batch: int, seconds: float) -> dict:
    """(in the cell's own process) images/s of the training step, and the policy OpenMP was started
    with."""
    import timm
    import torch

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images, labels = torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()

    for _ in range(2):
        step()
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < seconds:
        step()
        steps += 1
    return {
        "img_s": steps * batch / (time.perf_counter() - start),
        "steps": steps,
        "policy": os.environ.get("VISIONDIST_OMP_WAIT")
        or os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "threads": torch.get_num_threads(),
    }


def _run_rate(policy: str, steps: int, env: dict) -> dict:
    """(a cell of the "run" workload) the README's default run for `steps` steps: its steady-state
    images/s."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            str(REPO / "tools" / "train.py"),
            f"trainer.max_steps={steps}",
            f"trainer.run_dir={tmp}/run",
            "trainer.loggers=[csv]",
        ]
        subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, check=True)
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
        log = (Path(tmp) / "run" / "train.log").read_text()
    said = [
        line.split("OpenMP's waiting threads ", 1)[1]
        for line in log.splitlines()
        if "OpenMP's waiting" in line
    ]
    return {
        "img_s": summary["throughput, steady state (img/s)"],
        "steps": summary["steps"],
        "policy": said[0] if said else policy,
        "threads": int(summary.get("threads", 0) or 0),
    }


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process's ended
    children)."""
    import resource

    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq = map(int, f.readline().split()[1:8])
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (user + nice + system + irq + softirq) / os.sysconf(
        "SC_CLK_TCK"
    ), children.ru_utime + children.ru_stime


def _wait_for_quiet(below: float, patience: float) -> None:
    """Until the machine's other processes use less than `below` CPUs over a second, or `patience`
    seconds pass."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        (machine, _), start = _cpu_seconds(), time.perf_counter()
        time.sleep(1.0)
        if (_cpu_seconds()[0] - machine) / (time.perf_counter() - start) < below:
            return


def _cell(load: str, policy: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CHOSEN}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    (machine, ours), start = _cpu_seconds(), time.perf_counter()
    spinner = (
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
    )
    try:
        if spinner is not None:
            time.sleep(0.5)  # running before the cell starts, as a neighbour already at work
        if args.workload == "run":
            if policy == "default":
                env["GOMP_SPINCOUNT"] = "300000"
            result = _run_rate(policy, args.steps, env)
        else:
            child = [
                sys.executable,
                __file__,
                "--child",
                policy,
                "--batch",
                str(args.batch),
                "--seconds",
                str(args.seconds),
            ]
            out = subprocess.run(
                child, env=env, cwd=REPO, capture_output=True, text=True, check=True
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    (machine_after, ours_after), wall = _cpu_seconds(), time.perf_counter() - start
    others = max(0.0, (machine_after - machine) - (ours_after - ours)) / wall
    return {**result, "others": others}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=("step", "run"), default="step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="the step's batch")
    parser.add_argument(
        "--seconds", type=float, default=8.0, help="the step's timed seconds per cell (>= 3 steps)"
    )
    parser.add_argument("--steps", type=int, default=120, help="the run's steps per cell")
    parser.add_argument(
        "--quiet-below", type=float, default=0.15, help="CPUs others may use as a cell starts"
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=120.0, help="seconds a cell waits for that at most"
    )
    parser.add_argument(
        "--loads", default="idle,busy", help="which loads to run: idle, busy or both"
    )
    parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "visiondist":
            sys.path.insert(0, str(REPO))
            import visiondist  # noqa: F401 (its choice, before torch: what every tool and rank gets)
        print(json.dumps(_step_rate(args.batch, args.seconds)), flush=True)
        return

    loads = [x for x in ("idle", "busy") if x in args.loads.split(",")]
    cells = [cell for cell in CELLS if cell[0] in loads]
    rates: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    others: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    seen: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for load, policy in cells if r % 2 == 0 else cells[::-1]:
            _wait_for_quiet(args.quiet_below, args.quiet_wait)
            seen[load, policy] = _cell(load, policy, args)
            rates[load, policy].append(seen[load, policy]["img_s"])
            others[load, policy].append(seen[load, policy]["others"])
            print(
                f"round {r + 1}: {load:4} {policy:10} {rates[load, policy][-1]:7.1f} img/s "
                f"(others {others[load, policy][-1]:.2f} CPUs; {seen[load, policy]['policy']})",
                file=sys.stderr,
                flush=True,
            )
    med = {cell: statistics.median(v) for cell, v in rates.items()}
    what = (
        f"the default run (tools/train.py, {args.steps} steps, steady state)"
        if args.workload == "run"
        else f"timm ViT-Ti/16, 64 px, batch {args.batch}, fwd + bwd + AdamW, torch's default "
        f"threads ({seen['idle', 'default']['threads']})"
    )
    print(
        f"{what}, {os.cpu_count()} CPU cores; median of {args.rounds} rounds (img/s; each round's "
        "in brackets)"
    )
    print(
        f"| OpenMP waiting | {' | '.join(HEADS[x] for x in loads)} "
        f"|{' busy / idle |' if len(loads) == 2 else ''} others "
        f"(CPUs{', ' + ' / '.join(loads) if len(loads) == 2 else ''}) |"
    )
    print("|---" * (2 + len(loads) + (len(loads) == 2)) + "|")
    names = {
        "default": "torch's default (spins)",
        "passive": "`OMP_WAIT_POLICY=PASSIVE`",
        "visiondist": "visiondist's choice",
    }
    for policy in POLICIES:
        row = [
            f"{med[load, policy]:.1f} ({', '.join(f'{x:.1f}' for x in rates[load, policy])})"
            for load in loads
        ]
        if len(loads) == 2:
            row.append(f"{med['busy', policy] / med['idle', policy]:.3f}")
        row.append(" / ".join(f"{statistics.median(others[x, policy]):.2f}" for x in loads))
        print(f"| {names[policy]} | {' | '.join(row)} |")
    for load in loads:
        print(
            f"{load}: visiondist chose {seen[load, 'visiondist']['policy']!r}; visiondist / "
            f"default {med[load, 'visiondist'] / med[load, 'default']:.3f}, visiondist / passive "
            f"{med[load, 'visiondist'] / med[load, 'passive']:.3f}"
        )


if __name__ == "__main__":
    main()
