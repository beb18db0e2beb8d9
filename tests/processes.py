"""A running job's processes, found under /proc: what the fault tests kill and then check are
gone."""

from __future__ import annotations

from pathlib import Path


def _processes() -> list[tuple[int, int, bytes]]:
    """(pid, parent pid, command line) of every live process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            found.append((int(entry.name), ppid, (entry / "cmdline").read_bytes()))
        except (OSError, IndexError, ValueError):
            continue
    return found


def children(pid: int, marker: bytes) -> list[int]:
    """Children of `pid` whose command line holds `marker` (e.g. the script, for torchrun's
    workers)."""
    return [child for child, parent, cmdline in _processes() if parent == pid and marker in cmdline]


def rank_processes(launcher: int) -> list[int]:
    """The rank processes a self-launching job's process `launcher` started
    (visiondist.launch.spawn): spawned children (ranks on a GPU), forked children, whose command
    line is the launcher's (ranks on the CPU with one thread each), or the children of its fork
    server (ranks on the CPU with more)."""
    table = _processes()
    own = next((cmdline for pid, _, cmdline in table if pid == launcher), None)
    servers = {
        pid
        for pid, parent, cmdline in table
        if parent == launcher and b"multiprocessing.forkserver" in cmdline
    }
    return [
        pid
        for pid, parent, cmdline in table
        if (parent == launcher and (b"spawn_main" in cmdline or cmdline == own))
        or parent in servers
    ]
