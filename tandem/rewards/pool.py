"""A pool of reward worker processes with a per-call time limit that kills and replaces a hung or crashed worker.

Why not `multiprocessing.Pool` or `ProcessPoolExecutor`: neither can kill one hung task (the first waits forever,
the second breaks the whole pool when a worker dies), and their spawn start method re-imports the trainer's
`__main__` (and with it torch) in every worker. Workers here are plain `python -m tandem.rewards.worker`
subprocesses (started without fork, so safe from a process with threads; they import only `tandem.rewards`),
each in its own session, fed chunks of samples and answering per sample, so the time limit is per call while
the pipe round-trips are per chunk. When a call overruns, its worker and every process below it are killed
(`proctree`: the worker adopts its orphans, so a reward's `setsid` or double-forked process is found too), that
sample scores an error, the rest of its chunk goes back on the queue, and a fresh worker starts in its place.
When a `run()`'s deadline (the step's reward budget) passes, the calls in flight are killed the same way and
everything not scored yet is settled as `budget`.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping

from tandem.rewards.proctree import kill_tree


@dataclass(frozen=True)
class Job:
    """One function over some samples. `fn_bytes` is the function pickled by reference (module + name)."""

    key: str
    fn_bytes: bytes
    kwargs: dict
    batched: bool
    items: tuple[tuple[int, str, str, Mapping], ...]  # (index, completion, prompt, row)


@dataclass(frozen=True)
class Outcome:
    value: float | None  # None: the call failed, see kind
    kind: str = ""  # "", raised, bad_value, timeout, crashed, pool, budget
    message: str = ""


def _worker_env() -> dict[str, str]:
    # The worker must import what the trainer can: its sys.path (pytest's, a plugin's directory) as PYTHONPATH.
    paths = [p or os.getcwd() for p in sys.path]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))


class _Worker:
    def __init__(self, warm: list[bytes]):
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.rewards.worker", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL, env=_worker_env(), start_new_session=True)
        finally:
            os.close(down_r)
            os.close(up_w)
        self.tx = Connection(down_w, readable=False)
        self.rx = Connection(up_r, writable=False)
        try:
            self.tx.send(("warm", warm))
        except OSError:  # died at birth: the pool sees EOF on rx and counts a start failure
            pass
        self.started = time.monotonic()
        self.ready = False
        self.job: Job | None = None
        self.pending: deque[int] = deque()  # indices of the current job not answered yet, in order
        self.deadline = math.inf

    def kill(self) -> int | None:
        kill_tree(self.proc.pid)  # the worker and everything a reward started, whatever its session
        rc = self.proc.wait()
        for conn in (self.tx, self.rx):
            try:
                conn.close()
            except OSError:
                pass
        return rc


class RewardPool:
    """`workers` processes; `warm` functions get their `warmup()` called in each new worker, outside time limits."""

    def __init__(self, workers: int, warm: list[bytes] | None = None, startup_timeout_s: float = 120.0,
                 max_start_failures: int = 3):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.n = workers
        self.warm = list(warm or [])
        self.startup_timeout_s = startup_timeout_s
        self.max_start_failures = max_start_failures
        self.start_failures = 0  # consecutive workers that died or stalled before becoming ready
        self.restarts = 0  # workers replaced after a timeout or crash (a metric)
        self._workers: list[_Worker] = [_Worker(self.warm) for _ in range(workers)]

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self.warm)

    @staticmethod
    def _chunks(job: Job, n_workers: int) -> list[Job]:
        if job.batched or len(job.items) <= 1:
            return [job]
        size = max(1, math.ceil(len(job.items) / (2 * n_workers)))  # two chunks a worker: balance vs round-trips
        return [Job(job.key, job.fn_bytes, job.kwargs, False, job.items[i:i + size])
                for i in range(0, len(job.items), size)]

    def run(self, jobs: list[Job], timeout_s: float, deadline: float = math.inf,
            budget_message: str = "the reward budget ran out") -> dict[str, dict[int, Outcome]]:
        """Every item of every job gets an Outcome by `deadline` (time.monotonic()); never raises for what a reward
        does, never waits unbounded."""
        out: dict[str, dict[int, Outcome]] = {job.key: {} for job in jobs}
        queue: deque[Job] = deque(c for job in jobs for c in self._chunks(job, self.n))

        def settle(job: Job, indices, kind: str, message: str) -> None:
            for i in indices:
                out[job.key][i] = Outcome(None, kind, message)

        def assign(w: _Worker, job: Job) -> None:
            try:
                w.tx.send(("job", job.fn_bytes, job.kwargs, job.batched, job.items))
            except OSError:  # the worker died while idle: start another, retry there
                queue.appendleft(job)
                self._replace(w)
                return
            except Exception as exc:  # a row that cannot be pickled (pickling errors come in many types)
                settle(job, [it[0] for it in job.items], "raised", f"cannot send to the worker: {exc!r}"[:500])
                return
            w.job, w.pending = job, deque(it[0] for it in job.items)
            w.deadline = time.monotonic() + timeout_s

        def fail_current(w: _Worker, kind: str, message: str) -> None:
            job, pending = w.job, list(w.pending)
            w.job = None
            self.restarts += 1
            self._replace(w)
            if job.batched:
                settle(job, pending, kind, message)
                return
            settle(job, pending[:1], kind, message)
            rest = tuple(it for it in job.items if it[0] in set(pending[1:]))
            if rest:
                queue.appendleft(Job(job.key, job.fn_bytes, job.kwargs, False, rest))

        def out_of_time(message: str) -> None:
            while queue:
                job = queue.popleft()
                settle(job, [it[0] for it in job.items], "budget", message)
            for w in list(self._workers):
                if w.job is not None:
                    job, pending = w.job, list(w.pending)
                    w.job = None
                    self.restarts += 1
                    self._replace(w)
                    running = len(pending) if job.batched else 1
                    settle(job, pending[:running], "budget", f"{message} during this call; its worker was killed")
                    settle(job, pending[running:], "budget", message)

        for w in list(self._workers):  # notice workers that became ready (or died) since the last call
            if not w.ready:
                self._drain(w, out, fail_current, timeout_s)
        while queue or any(w.job is not None for w in self._workers):
            for w in list(self._workers):
                if w.ready and w.job is None and queue:
                    assign(w, queue.popleft())
            if self.start_failures >= self.max_start_failures and not any(w.ready for w in self._workers):
                while queue:  # workers cannot start at all: score what is left as errors, do not spin
                    job = queue.popleft()
                    settle(job, [it[0] for it in job.items], "pool", "reward workers fail to start")
                continue
            now = time.monotonic()
            if now >= deadline:
                out_of_time(budget_message)
                break
            watched = [w for w in self._workers if w.job is not None or not w.ready]
            if not watched:
                continue
            deadlines = [w.deadline if w.ready else w.started + self.startup_timeout_s for w in watched]
            ready = wait([w.rx for w in watched], timeout=max(0.0, min(deadlines + [deadline]) - now))
            for conn in ready:
                w = next((x for x in self._workers if x.rx is conn), None)
                if w is not None:
                    self._drain(w, out, fail_current, timeout_s)
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.job is not None and now > w.deadline:
                    fail_current(w, "timeout", f"no result within {timeout_s:g} s; worker killed")
                elif not w.ready and now > w.started + self.startup_timeout_s:
                    self.start_failures += 1
                    self._replace(w)
        return out

    def _drain(self, w: _Worker, out: dict[str, dict[int, Outcome]], fail_current, timeout_s: float) -> None:
        while True:
            try:
                if not w.rx.poll():
                    return
                msg: Any = w.rx.recv()
            except (EOFError, OSError):
                rc = w.proc.wait()
                if not w.ready:
                    self.start_failures += 1
                    self._replace(w)
                elif w.job is not None:
                    fail_current(w, "crashed", f"worker process died (exit code {rc})")
                else:
                    self._replace(w)
                return
            tag = msg[0]
            if tag == "ready":
                w.ready, self.start_failures = True, 0
            elif tag == "ok":
                out[w.job.key][msg[1]] = Outcome(msg[2])
                w.pending.popleft()
                w.deadline = time.monotonic() + timeout_s
            elif tag == "err":
                out[w.job.key][msg[1]] = Outcome(None, msg[2], msg[3])
                w.pending.popleft()
                w.deadline = time.monotonic() + timeout_s
            elif tag == "batch":
                for index, value, kind, message in msg[1]:
                    out[w.job.key][index] = Outcome(value, kind, message)
                w.pending.clear()
            elif tag == "done":
                w.job, w.deadline = None, math.inf

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
