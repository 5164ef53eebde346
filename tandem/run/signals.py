"""SIGTERM and SIGINT during a run: the first lets it finish what it has started and save, a second stops it at once."""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("tandem.run.signals")

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Stopped(BaseException):
    """A run stopped by a signal. A BaseException, as KeyboardInterrupt is: an `except Exception` meant for a step's
    errors must not swallow a stop.

    `second`: a second signal stopped the run at once, unsaved. `step`: the last step the run completed (None when
    it stopped while starting, or at once). `checkpoint`: the one a resume starts from (None: there is none);
    `saved`: this stop wrote it."""

    def __init__(self, signum: int, second: bool = False):
        super().__init__(signum, second)
        self.signum, self.second = signum, second
        self.step: int | None = None
        self.checkpoint: Path | None = None
        self.saved = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process ended by this signal: 143 SIGTERM, 130 SIGINT

    def describe(self, resume: str, start: str) -> str:
        """One line: how it stopped, what is on disk, and the command (`resume` or `start`) that continues."""
        if self.second:
            how = f"stopped at once by a second {self.name}"
        elif self.step is None:
            how = f"stopped by {self.name} while starting"
        else:
            how = f"stopped by {self.name} after step {self.step}"
        if self.checkpoint is None:
            return f"{how}; no checkpoint; start again with: {start}"
        where = (f"checkpoint {self.checkpoint}" if self.saved
                 else f"not saved; the last checkpoint is {self.checkpoint}")
        return f"{how}; {where}; resume with: {resume}"

    def __str__(self) -> str:
        return self.describe("--resume", "the same command")


class StopSignals:
    """SIGTERM and SIGINT handling for one run, as a context manager that puts the previous handlers back.

    While starting, a signal stops at once: no step has finished, there is nothing to save. Once `running()`, the
    first signal is only recorded (`signum`); the run stops at its next safe point (`check()`), saves and closes. A
    second one raises `Stopped` wherever the run is: an unfinished checkpoint is never published, so the last one
    stays whole. While closing (`closing()`), signals are logged and nothing more: stopping the workers takes
    seconds, and cutting it short would leave processes behind.

    Python runs handlers in the main thread only: from any other thread nothing is installed and the caller keeps
    its own. A signal ignored when the run starts (a `nohup` or background job) stays ignored.
    """

    def __init__(self, then: str = "then saves a checkpoint"):
        self.then = then  # what the run does after the first signal, for its log line
        self.signum: int | None = None
        self._state = "starting"
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                previous = signal.getsignal(sig)
                if previous != signal.SIG_IGN:
                    self._previous[sig] = previous
                    signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def running(self) -> None:
        self._state = "running"

    @contextmanager
    def closing(self) -> Iterator[None]:
        self._state = "closing"
        yield

    def check(self) -> None:
        """At a safe point: leave what is in progress if a stop was asked for."""
        if self.signum is not None:
            raise Stopped(self.signum)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self._state == "closing":
            log.warning("%s: the run is already closing its workers", name)
            return
        if self._state == "starting" or self.signum is not None:
            second = self.signum is not None
            self._state = "closing"  # from here the run only unwinds and closes
            raise Stopped(signum, second=second)
        self.signum = signum
        log.warning("%s: stopping after the update in progress; the run %s. A second signal stops it at once, "
                    "unsaved", name, self.then)
