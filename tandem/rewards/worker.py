"""A reward pool worker process: `python -m tandem.rewards.worker READ_FD WRITE_FD`, driven by `tandem.rewards.pool`.

Protocol (pickled tuples over two pipes). Parent -> worker: `("warm", [fn_bytes])` once, then
`("job", fn_bytes, kwargs, batched, items)` with items `[(index, completion, prompt, row)]`. Worker -> parent:
`("ready",)` after warm-up; per sample `("ok", index, score)` or `("err", index, kind, message)` as each finishes
(so the parent's time limit is per call, not per chunk); for a batched job one `("batch", [(index, score | None,
kind, message)])`; then `("done",)`.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from tandem.rewards.base import _finite


def _watch_parent(parent: int) -> None:
    """Exit when the trainer is gone, even if a reward is hung (a closed pipe is noticed only between jobs)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _score_one(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[float | None, str, str]:
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a reward is a failure of that sample, too
        return None, "raised", repr(exc)[:500]
    try:
        return _finite(value), "", ""
    except Exception as exc:
        return None, "bad_value", str(exc)[:500]


def _run_job(fn: Callable[..., Any], kwargs: dict, batched: bool, items: list, tx: Connection) -> None:
    if not batched:
        for index, completion, prompt, row in items:
            value, kind, message = _score_one(fn, (completion, prompt, row), kwargs)
            tx.send(("ok", index, value) if kind == "" else ("err", index, kind, message))
        return
    out = []
    try:
        values = list(fn([it[1] for it in items], [it[2] for it in items], [it[3] for it in items], **kwargs))
        if len(values) != len(items):
            raise ValueError(f"returned {len(values)} scores for {len(items)} completions")
    except BaseException as exc:  # noqa: BLE001
        out = [(it[0], None, "raised", repr(exc)[:500]) for it in items]
    else:
        for it, value in zip(items, values):
            try:
                out.append((it[0], _finite(value), "", ""))
            except Exception as exc:
                out.append((it[0], None, "bad_value", str(exc)[:500]))
    tx.send(("batch", out))


def main(read_fd: int, write_fd: int) -> None:
    rx, tx = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    os.dup2(2, 1)  # a reward's print() goes to stderr; stdout is not ours to use
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cache: dict[bytes, Callable[..., Any]] = {}
    msg = rx.recv()
    for fn_bytes in msg[1]:
        try:  # a broken warm-up is not fatal: the samples will report the real error
            fn = cache.setdefault(fn_bytes, pickle.loads(fn_bytes))
            warm = getattr(fn, "warmup", None)
            if callable(warm):
                warm()
        except Exception as exc:
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
        tx.send(("done",))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
