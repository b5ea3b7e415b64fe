"""What Linux's /proc says of a process: its state, its parent, when it started, and the
processes below it. For the tests that check what a process left running, and for the
engine watch (enginewatch.py), which stops everything a run started."""

from __future__ import annotations

import os


def stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name: [0] the state, [1] the
    parent, [19] the start time. None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()
    except OSError:
        return None


def running(pid: int, start: str | None = None) -> bool:
    """The process is there and not ended (a zombie, or dead); with `start`, it is still
    the process that started then, not a later one given the same pid."""
    fields = stat(pid)
    return (
        fields is not None
        and fields[0] not in ("Z", "X")
        and (start is None or fields[19] == start)
    )


def descendants(root: int) -> dict[int, tuple[str, int]]:
    """Every process below `root`, each with its start time (to know it again) and its
    parent."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := stat(entry.name)):
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    found: dict[int, tuple[str, int]] = {}
    todo = [(pid, start, root) for pid, start in children.get(root, [])]
    while todo:
        pid, start, parent = todo.pop()
        found[pid] = (start, parent)
        todo.extend((child, begun, pid) for child, begun in children.get(pid, []))
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [child for child, (_, parent) in descendants(pid).items() if parent == pid]
