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
        return _Round(self, jobs, timeout_s).run(deadline, budget_message)

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Round:
    """One `RewardPool.run`: its queue of chunks, its outcomes, and what happens to a worker's call."""

    def __init__(self, pool: RewardPool, jobs: list[Job], timeout_s: float):
        self.pool, self.timeout_s = pool, timeout_s
        self.out: dict[str, dict[int, Outcome]] = {job.key: {} for job in jobs}
        self.queue: deque[Job] = deque(c for job in jobs for c in pool._chunks(job, pool.n))

    def run(self, deadline: float, budget_message: str) -> dict[str, dict[int, Outcome]]:
        pool = self.pool
        for w in list(pool._workers):  # notice workers that became ready (or died) since the last call
            if not w.ready:
                self.drain(w)
        while self.queue or any(w.job is not None for w in pool._workers):
            for w in list(pool._workers):
                if w.ready and w.job is None and self.queue:
                    self.assign(w, self.queue.popleft())
            if pool.start_failures >= pool.max_start_failures and not any(w.ready for w in pool._workers):
                self.settle_queued("pool", "reward workers fail to start")  # do not spin
                continue
            if time.monotonic() >= deadline:
                self.out_of_time(budget_message)
                break
            self.wait(deadline)
        return self.out

    def wait(self, deadline: float) -> None:
        """Until a watched worker answers or one's time is up (or `deadline`); then what answered is read, and an
        overrunning call or a worker that does not start is dealt with."""
        pool, now = self.pool, time.monotonic()
        watched = [w for w in pool._workers if w.job is not None or not w.ready]
        if not watched:
            return
        deadlines = [w.deadline if w.ready else w.started + pool.startup_timeout_s for w in watched]
        ready = wait([w.rx for w in watched], timeout=max(0.0, min(deadlines + [deadline]) - now))
        for conn in ready:
            w = next((x for x in pool._workers if x.rx is conn), None)
            if w is not None:
                self.drain(w)
        now = time.monotonic()
        for w in list(pool._workers):
            if w.ready and w.job is not None and now > w.deadline:
                self.fail_current(w, "timeout", f"no result within {self.timeout_s:g} s; worker killed")
            elif not w.ready and now > w.started + pool.startup_timeout_s:
                pool.start_failures += 1
                pool._replace(w)

    def settle(self, job: Job, indices, kind: str, message: str) -> None:
        for i in indices:
            self.out[job.key][i] = Outcome(None, kind, message)

    def settle_queued(self, kind: str, message: str) -> None:
        while self.queue:
            job = self.queue.popleft()
            self.settle(job, [it[0] for it in job.items], kind, message)

    def assign(self, w: _Worker, job: Job) -> None:
        try:
            w.tx.send(("job", job.fn_bytes, job.kwargs, job.batched, job.items))
        except OSError:  # the worker died while idle: start another, retry there
            self.queue.appendleft(job)
            self.pool._replace(w)
            return
        except Exception as exc:  # a row that cannot be pickled (pickling errors come in many types)
            self.settle(job, [it[0] for it in job.items], "raised", f"cannot send to the worker: {exc!r}"[:500])
            return
        w.job, w.pending = job, deque(it[0] for it in job.items)
        w.deadline = time.monotonic() + self.timeout_s

    def fail_current(self, w: _Worker, kind: str, message: str) -> None:
        job, pending = w.job, list(w.pending)
        w.job = None
        self.pool.restarts += 1
        self.pool._replace(w)
        if job.batched:
            self.settle(job, pending, kind, message)
            return
        self.settle(job, pending[:1], kind, message)
        rest = tuple(it for it in job.items if it[0] in set(pending[1:]))
        if rest:
            self.queue.appendleft(Job(job.key, job.fn_bytes, job.kwargs, False, rest))

    def out_of_time(self, message: str) -> None:
        self.settle_queued("budget", message)
        for w in list(self.pool._workers):
            if w.job is not None:
                job, pending = w.job, list(w.pending)
                w.job = None
                self.pool.restarts += 1
                self.pool._replace(w)
                running = len(pending) if job.batched else 1
                self.settle(job, pending[:running], "budget", f"{message} during this call; its worker was killed")
                self.settle(job, pending[running:], "budget", message)

    def drain(self, w: _Worker) -> None:
        """Read what `w` has sent so far: outcomes, its readiness, or its death."""
        pool, out = self.pool, self.out
        while True:
            try:
                if not w.rx.poll():
                    return
                msg: Any = w.rx.recv()
            except (EOFError, OSError):
                rc = w.proc.wait()
                if not w.ready:
                    pool.start_failures += 1
                    pool._replace(w)
                elif w.job is not None:
                    self.fail_current(w, "crashed", f"worker process died (exit code {rc})")
                else:
                    pool._replace(w)
                return
            tag = msg[0]
            if tag == "ready":
                w.ready, pool.start_failures = True, 0
            elif tag == "ok":
                out[w.job.key][msg[1]] = Outcome(msg[2])
                w.pending.popleft()
                w.deadline = time.monotonic() + self.timeout_s
            elif tag == "err":
                out[w.job.key][msg[1]] = Outcome(None, msg[2], msg[3])
                w.pending.popleft()
                w.deadline = time.monotonic() + self.timeout_s
            elif tag == "batch":
                for index, value, kind, message in msg[1]:
                    out[w.job.key][index] = Outcome(value, kind, message)
                w.pending.clear()
            elif tag == "done":
                w.job, w.deadline = None, math.inf
