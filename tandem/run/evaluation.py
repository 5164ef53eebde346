"""Evaluation on held-out prompts: greedy accuracy, and sampled pass@k / mean@k with the unbiased estimator."""
from __future__ import annotations

import dataclasses
from math import comb

from tandem.data.sources import Prompt
from tandem.rewards.base import RewardResult, RewardScorer
from tandem.rollout.base import Sampling


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c of them correct, is correct)
    = 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, the unbiased estimator)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(generate, prompts: list[Prompt], scorer: RewardScorer, correct_reward: str, sampling: Sampling,
             k: int = 1, temperature: float = 1.0) -> dict[str, float]:
    """Greedy accuracy, and with `k` > 1 pass@k / mean@k of k samples at `temperature`, both drawn as `sampling`
    says otherwise (the run's: `sampling_for`). `generate(prompt_ids, sampling) -> Samples` (group = the prompt's
    index). A sample is correct when `correct_reward` scores >= 1. A reward that fails scores 0 here as in training,
    and is counted: `reward_errors/<name>[/<kind>]`, over the greedy and the sampled pass."""
    ids = [p.ids for p in prompts]
    rows = [p.row for p in prompts]
    out: dict[str, float] = {}

    def count_errors(res: RewardResult) -> None:
        for key, n in res.error_counts("reward_errors").items():
            out[key] = out.get(key, 0) + n

    greedy = generate(ids, dataclasses.replace(sampling, n=1, temperature=0.0)).completions
    res = scorer.score([c.text for c in greedy], [r["question"] for r in rows], rows)
    count_errors(res)
    correct = [s >= 1.0 for s in res.per_fn[correct_reward]]
    out["accuracy"] = sum(correct) / len(correct)
    out["reward"] = sum(res.total) / len(res.total)
    if any("tool_calls" in c.meta for c in greedy):  # multi-turn: how often the greedy answers use a tool
        out["tool_call_frac"] = sum(c.meta["tool_calls"] > 0 for c in greedy) / len(greedy)
    if k > 1:
        sampled = generate(ids, dataclasses.replace(sampling, n=k, temperature=temperature))
        of = sampled.group.tolist()
        res = scorer.score([c.text for c in sampled.completions], [rows[g]["question"] for g in of], [rows[g] for g in of])
        count_errors(res)
        hits = [0] * len(prompts)
        for g, s in zip(of, res.per_fn[correct_reward]):
            hits[g] += s >= 1.0
        for kk in sorted({1, 2, k} & set(range(1, k + 1))):
            out[f"pass@{kk}"] = sum(pass_at_k(k, h, kk) for h in hits) / len(hits)
        out[f"mean@{k}"] = sum(hits) / (k * len(hits))
    return out
