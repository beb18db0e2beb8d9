"""A training step beside a busy process: OpenMP's waiting threads spinning (torch's default) or sleeping (what
visiondist sets, `OMP_WAIT_POLICY=PASSIVE`, `visiondist.utils.procenv`).

Each cell is a fresh process (OpenMP reads its policy once, when torch loads it) that trains timm's ViT-Ti/16 at
64 px, batch 64, forward + backward + AdamW, torch's default threads, for at least `--seconds` after two warm-up
steps, and reports images/s: on an idle CPU, and beside one spinning Python process (a busy neighbour), each with
torch's default policy (the process imports torch only) and with visiondist's (it imports visiondist first, as every
tool and rank does). The four cells run in turn, the order reversed every other round; the table gives each cell's
median over the rounds and the ratios that matter: busy / idle per policy (goal: busy within 2x of idle) and what
the passive policy costs on an idle CPU (goal: at most 2%). "Others" is the CPU time other processes of the machine
(not this benchmark's) used during the cells, in CPUs: on a shared machine "idle" is only as idle as that says;
each cell waits (up to --quiet-wait seconds) for the others to use less than --quiet-below CPUs before it starts.

    python benchmarks/omp_wait.py                  # 3 rounds
    python benchmarks/omp_wait.py --rounds 5 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CELLS = (("idle", "default"), ("idle", "passive"), ("busy", "default"), ("busy", "passive"))


def _step_rate(batch: int, seconds: float) -> dict:
    """(in the cell's own process) images/s of the training step, and the policy OpenMP was started with."""
    import torch
    import timm

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
    return {"img_s": steps * batch / (time.perf_counter() - start), "steps": steps,
            "policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"), "threads": torch.get_num_threads()}


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process's ended children)."""
    import resource

    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq = map(int, f.readline().split()[1:8])
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), children.ru_utime + children.ru_stime


def _wait_for_quiet(below: float, patience: float) -> None:
    """Until the machine's other processes use less than `below` CPUs over a second, or `patience` seconds pass."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        (machine, _), start = _cpu_seconds(), time.perf_counter()
        time.sleep(1.0)
        if (_cpu_seconds()[0] - machine) / (time.perf_counter() - start) < below:
            return


def _cell(load: str, policy: str, batch: int, seconds: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    child = [sys.executable, __file__, "--child", policy, "--batch", str(batch), "--seconds", str(seconds)]
    (machine, ours), start = _cpu_seconds(), time.perf_counter()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
    try:
        out = subprocess.run(child, env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    (machine_after, ours_after), wall = _cpu_seconds(), time.perf_counter() - start
    others = max(0.0, (machine_after - machine) - (ours_after - ours)) / wall
    return {**json.loads(out.strip().splitlines()[-1]), "others": others}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per cell (at least 3 steps)")
    parser.add_argument("--quiet-below", type=float, default=0.15, help="CPUs others may use as a cell starts")
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="seconds a cell waits for that at most")
    parser.add_argument("--child", choices=("default", "passive"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "passive":
            sys.path.insert(0, str(REPO))
            import visiondist  # noqa: F401 (its environment, before torch: what every tool and rank gets)
        print(json.dumps(_step_rate(args.batch, args.seconds)), flush=True)
        return

    rates: dict[tuple[str, str], list[float]] = {cell: [] for cell in CELLS}
    others: dict[tuple[str, str], list[float]] = {cell: [] for cell in CELLS}
    seen: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for load, policy in (CELLS if r % 2 == 0 else CELLS[::-1]):
            _wait_for_quiet(args.quiet_below, args.quiet_wait)
            seen[load, policy] = _cell(load, policy, args.batch, args.seconds)
            rates[load, policy].append(seen[load, policy]["img_s"])
            others[load, policy].append(seen[load, policy]["others"])
            print(f"round {r + 1}: {load:4} {policy:7} {rates[load, policy][-1]:7.1f} img/s "
                  f"({seen[load, policy]['steps']} steps; others {others[load, policy][-1]:.2f} CPUs)",
                  file=sys.stderr, flush=True)
    med = {cell: statistics.median(v) for cell, v in rates.items()}
    print(f"timm ViT-Ti/16, 64 px, batch {args.batch}, fwd + bwd + AdamW, torch's default threads "
          f"({seen['idle', 'default']['threads']}), {os.cpu_count()} CPU cores; median of {args.rounds} rounds "
          f"(img/s; each round's figures in brackets)")
    print("| OpenMP waiting | idle CPU | beside one busy process | busy / idle | others (CPUs, idle / busy) |")
    print("|---|---|---|---|---|")
    for policy, name in (("default", "torch's default (spins; OMP_WAIT_POLICY unset)"),
                         ("passive", f"visiondist (OMP_WAIT_POLICY={seen['idle', 'passive']['policy']})")):
        cells = [f"{med[load, policy]:.1f} ({', '.join(f'{x:.1f}' for x in rates[load, policy])})"
                 for load in ("idle", "busy")]
        load = " / ".join(f"{statistics.median(others[x, policy]):.2f}" for x in ("idle", "busy"))
        print(f"| {name} | {cells[0]} | {cells[1]} | {med['busy', policy] / med['idle', policy]:.3f} | {load} |")
    print(f"passive / default on the idle CPU: {med['idle', 'passive'] / med['idle', 'default']:.3f}; "
          f"beside the busy process: {med['busy', 'passive'] / med['busy', 'default']:.2f}x")


if __name__ == "__main__":
    main()
