"""A reward with spread on a random tiny model (used as a `module:function` plugin by the trainer tests)."""


def text_length(completion: str, prompt: str, row, **_) -> float:
    return float(len(completion))


def text_code(completion: str, prompt: str, row, **_) -> float:
    """Differs between almost any two different completions, even of one length (a group of fixed-length samples
    whose text lengths all agree would give text_length no spread, and its update no gradient)."""
    return float(sum(map(ord, completion)) % 101)


def raises(completion: str, prompt: str, row, **_) -> float:
    raise RuntimeError("reward bug")


def hangs(completion: str, prompt: str, row, **_) -> float:
    import time

    time.sleep(3600)
    return 1.0


def kills_worker(completion: str, prompt: str, row, **_) -> float:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def not_a_number(completion: str, prompt: str, row, **_):
    return float("nan") if len(completion) % 2 else "high"


def matches_target(completion: str, prompt: str, row, **_) -> float:
    return float(completion.strip() == row["target"])


def always_one(completion: str, prompt: str, row, **_) -> float:
    return 1.0
