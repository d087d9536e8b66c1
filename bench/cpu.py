"""CPU accounting shared by the benches: what a process tree and the whole machine spent."""

from __future__ import annotations

import os

CLK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int | None) -> float:
    """utime + stime of a process, all its threads and its live descendants (a proxy with
    --workers N is a supervisor and N worker processes), seconds; 0 when unknown."""
    if pid is None:
        return 0.0
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        f = stats.get(p)
        if f:
            total += int(f[11]) + int(f[12])  # utime, stime (fields 14, 15 of stat)
    return total / CLK


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / CLK  # minus idle and iowait
