"""This test process's live descendants, read from /proc (Ray's raylet, gcs_server and actors are among them)."""
from __future__ import annotations

from pathlib import Path


def descendants() -> list[tuple[int, str]]:
    """(pid, command line) of every live process descended from this one; zombies are left out."""
    import os

    kids: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # gone meanwhile
        kids.setdefault(int(ppid), []).append((int(stat.parent.name), state))
    found, todo = [], [os.getpid()]
    while todo:
        for pid, state in kids.get(todo.pop(), []):
            todo.append(pid)
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if state != "Z":
                found.append((pid, cmd))
    return found
