"""Misbehaving and plugin rewards for the pool tests, importable by worker processes as `bad_rewards:<name>`."""
from __future__ import annotations

import os
import signal
import time


def good(completion, prompt, row):
    return float(len(completion))


def raises(completion, prompt, row):
    raise RuntimeError(f"boom on {completion}")


def sleeps(completion, prompt, row):
    if completion == "hang":
        time.sleep(10_000)
    return 1.0


def kills_worker(completion, prompt, row):
    if completion == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if completion == "exit":
        os._exit(7)
    return 1.0


def returns_nan(completion, prompt, row):
    return float("nan")


def returns_string(completion, prompt, row):
    return "1.0"


def returns_none(completion, prompt, row):
    return None


def exits(completion, prompt, row):
    raise SystemExit(0)


def with_row(completion, prompt, row, bonus=0.0):
    """A plugin that reads the prompt and the dataset row."""
    return float(completion == row["target"] and prompt.startswith("Q")) + bonus


def batch_lengths(completions, prompts, rows):
    return [float(len(c)) for c in completions]


batch_lengths.batched = True


def batch_hangs(completions, prompts, rows):
    time.sleep(10_000)


batch_hangs.batched = True


def pid(completion, prompt, row):
    return float(os.getpid())


def exits_inline(completion, prompt, row):
    raise SystemExit(3)


exits_inline.inline = True


def interrupts_inline(completion, prompt, row):
    raise KeyboardInterrupt


interrupts_inline.inline = True


class _ExitsWhenRead:
    """A score whose value is never given: reading it calls sys.exit() (a reward's own number type gone wrong)."""

    def __float__(self):
        raise SystemExit(4)


def returns_exiting_number(completion, prompt, row):
    return _ExitsWhenRead()


def returns_exiting_number_inline(completion, prompt, row):
    return _ExitsWhenRead()


returns_exiting_number_inline.inline = True


def batch_returns_exiting_numbers(completions, prompts, rows):
    return [_ExitsWhenRead() for _ in completions]


batch_returns_exiting_numbers.batched = True


def _exit_five(**kwargs):
    raise SystemExit(5)


def exits_in_warmup(completion, prompt, row):
    return 1.0


exits_in_warmup.warmup = _exit_five


def exits_in_preflight(completion, prompt, row):
    return 1.0


exits_in_preflight.preflight = _exit_five


def slow_inline(completion, prompt, row):
    time.sleep(0.3)
    return 1.0


slow_inline.inline = True


def starts_setsid_sleeper(completion, prompt, row):
    """Leaves a process in its own session (out of the worker's process group) running; returns its pid."""
    import subprocess

    return float(subprocess.Popen(["sleep", "600"], start_new_session=True).pid)


def double_forks_a_sleeper(completion, prompt, row):
    """Daemonizes a sleeper the classic way (fork, setsid, fork, parent exits); returns the orphan's pid."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.execvp("sleep", ["sleep", "600"])
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 32))
    os.close(r)
    os.waitpid(child, 0)
    return float(pid)


def starts_sleeper_then_hangs(completion, prompt, row, pidfile=""):
    import subprocess

    with open(pidfile, "w") as f:
        f.write(str(subprocess.Popen(["sleep", "600"], start_new_session=True).pid))
    time.sleep(10_000)



def returns_huge(completion, prompt, row):
    """Finite in float64 and beyond float32's range (its largest is about 3.4e38)."""
    return 1e39


def returns_huge_inline(completion, prompt, row):
    return 1e39


returns_huge_inline.inline = True


def batch_returns_huge(completions, prompts, rows):
    return [1e39 if c == "huge" else 1.0 for c in completions]


batch_returns_huge.batched = True


def right_is_3e38(completion, prompt, row):
    """3e38 for a right answer: within float32's range alone; two such rewards summed are not."""
    return 3e38 if completion == "right" else 0.0


right_is_3e38.inline = True
