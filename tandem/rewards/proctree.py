"""Process trees without privileges: keep a reward worker's orphans in its tree, and kill a tree to the last process.

A reward may start processes that leave the worker's process group (`setsid`, `start_new_session=True`, a double
fork), so killing the group misses them. A cgroup would hold them whatever they do, but needs root or a delegated
cgroup; a pid namespace needs root or user namespaces. `PR_SET_CHILD_SUBREAPER` (Linux 3.4+) needs nothing: with it
set in the worker, a process whose parent exits is re-parented to the worker instead of to init, so every process
a reward starts stays a descendant of the worker for as long as the worker lives, and the tree walk below (parent
links in /proc) finds them all.
"""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children rather than init's; False where Linux refuses."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def reap_orphans() -> None:
    """Collect exited children, so the orphans a subreaper adopts do not pile up as zombies."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def descendants(root: int) -> set[int]:
    """Every live process below `root`, by the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])  # after the command name, which may hold ")"
        except (OSError, IndexError, ValueError):  # exited while we looked
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int, include_root: bool = True) -> None:
    """SIGKILL everything below `root` (and `root`). Each process is stopped before the next look, so none can fork
    a new one unseen, and none is killed before all are stopped, so no orphan leaves the tree while we look."""
    stopped: set[int] = set()
    if include_root:
        _signal(root, signal.SIGSTOP)
    while found := descendants(root) - stopped:
        for pid in found:
            _signal(pid, signal.SIGSTOP)
        stopped |= found
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    if include_root:
        _signal(root, signal.SIGKILL)
