"""A reward pool worker process: `python -m tandem.rewards.worker READ_FD WRITE_FD`, driven by `tandem.rewards.pool`.

Protocol (pickled tuples over two pipes). Parent -> worker: `("warm", [fn_bytes])` once, then
`("job", fn_bytes, kwargs, batched, items)` with items `[(index, completion, prompt, row)]`. Worker -> parent:
`("ready",)` after warm-up; per sample `("ok", index, score)` or `("err", index, kind, message)` as each finishes
(so the parent's time limit is per call, not per chunk); for a batched job one `("batch", [(index, score | None,
kind, message)])`; then `("done",)`.

The worker is its orphans' reaper (`proctree`): what a reward starts stays below it, so the pool can kill it all,
and when the trainer dies the worker kills it all itself before it exits.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from tandem.rewards.base import REWARD_FAILURES, call_batched, call_one
from tandem.rewards.proctree import become_subreaper, kill_tree, reap_orphans


def _watch_parent(parent: int) -> None:
    """Exit when the trainer is gone, even if a reward is hung (a closed pipe is noticed only between jobs), and
    take what the rewards started along."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            kill_tree(os.getpid(), include_root=False)
            os._exit(3)


def _run_job(fn: Callable[..., Any], kwargs: dict, batched: bool, items: list, tx: Connection) -> None:
    if not batched:
        for index, completion, prompt, row in items:
            value, kind, message = call_one(fn, (completion, prompt, row), kwargs)
            tx.send(("ok", index, value) if kind == "" else ("err", index, kind, message))
        return
    outcomes = call_batched(fn, [it[1] for it in items], [it[2] for it in items], [it[3] for it in items], kwargs)
    tx.send(("batch", [(it[0], *o) for it, o in zip(items, outcomes)]))


def main(read_fd: int, write_fd: int) -> None:
    rx, tx = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    os.dup2(2, 1)  # a reward's print() goes to stderr; stdout is not ours to use
    become_subreaper()  # where Linux refuses, a double-forked process can escape the kill (said in the README)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cache: dict[bytes, Callable[..., Any]] = {}
    msg = rx.recv()
    for fn_bytes in msg[1]:
        try:  # a broken warm-up is not fatal: the samples will report the real error
            fn = cache.setdefault(fn_bytes, pickle.loads(fn_bytes))
            warm = getattr(fn, "warmup", None)
            if callable(warm):
                warm()
        except REWARD_FAILURES as exc:
            print(f"tandem reward worker: warm-up failed: {exc!r}", file=sys.stderr)
    tx.send(("ready",))
    while True:
        try:
            msg = rx.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "job":
            return
        _, fn_bytes, kwargs, batched, items = msg
        try:
            fn = cache.get(fn_bytes) or cache.setdefault(fn_bytes, pickle.loads(fn_bytes))
        except Exception as exc:
            err = f"cannot load the reward function in the worker: {exc!r}"[:500]
            if batched:
                tx.send(("batch", [(it[0], None, "raised", err) for it in items]))
            else:
                for it in items:
                    tx.send(("err", it[0], "raised", err))
        else:
            _run_job(fn, kwargs, batched, items, tx)
        reap_orphans()
        tx.send(("done",))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
