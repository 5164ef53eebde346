"""Rewards: text -> score. Importing this registers the built-ins (gsm8k, math, format, tag_count, code,
length_penalty, repetition_penalty); see `base` for the signature a plugin (`module:function`) must have."""
from tandem.rewards import answers, coding, formatting, penalties  # noqa: F401  (registration)
from tandem.rewards.answers import extract_number, math_equal, numbers_equal
from tandem.rewards.base import REWARDS, RewardFn, RewardResult, RewardScorer, register_reward, resolve_reward
from tandem.rewards.coding import extract_code
from tandem.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = ["REWARDS", "RewardFn", "RewardResult", "RewardScorer", "register_reward", "resolve_reward",
           "extract_number", "numbers_equal", "math_equal", "extract_code", "SandboxLimits", "SandboxResult",
           "run_python"]
