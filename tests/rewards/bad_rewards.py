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
