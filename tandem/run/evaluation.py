"""Evaluation on held-out prompts: greedy accuracy, and sampled pass@k / mean@k with the unbiased estimator."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from math import comb
from pathlib import Path

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


@dataclasses.dataclass
class Evaluation:
    """One evaluation. `figures`: what the run logs (`eval/...`): accuracy and reward of the greedy answers, with
    k > 1 pass@k and mean@k, reward errors. `per_reward` and `per_task`: the same, a sample counted correct by each
    reward (score >= 1) and over each task's prompts (a row's `task` field, else the run's task). `samples`: every
    prompt's completions (the greedy one, then the k sampled), with each reward's score."""

    figures: dict[str, float]
    per_reward: dict[str, dict[str, float]]
    per_task: dict[str, dict[str, float]]
    samples: list[dict]
    prompts: int


def evaluate(generate, prompts: list[Prompt], scorer: RewardScorer, correct_reward: str, sampling: Sampling,
             k: int = 1, temperature: float = 1.0, task: str = "") -> Evaluation:
    """Greedy accuracy, and with `k` > 1 pass@k / mean@k of k samples at `temperature`, both drawn as `sampling`
    says otherwise (the run's: `sampling_for`). `generate(prompts, sampling) -> Samples` (group = the prompt's
    index). A sample is correct when `correct_reward` scores >= 1. A reward that fails scores 0 here as in training,
    and is counted: `reward_errors/<name>[/<kind>]`, over the greedy and the sampled pass. `task`: the task of rows
    that name none."""
    rows = [p.row for p in prompts]
    tasks = [str(r.get("task") or task) for r in rows]
    out: dict[str, float] = {}
    samples: list[dict] = []

    def scored(comps, of: list[int], kind: str) -> RewardResult:
        res = scorer.score([c.text for c in comps], [rows[g]["question"] for g in of], [rows[g] for g in of])
        for key, n in res.error_counts("reward_errors").items():
            out[key] = out.get(key, 0) + n
        for j, (c, g) in enumerate(zip(comps, of)):
            images = {"images": [im.name for im in rows[g]["_images"]]} if rows[g].get("_images") else {}
            samples.append({"prompt_index": g, "task": tasks[g], "question": rows[g]["question"], **images,
                            "kind": kind, "completion": c.text, "reward": res.total[j],
                            "scores": {name: s[j] for name, s in res.per_fn.items()}})
        return res

    greedy = generate(prompts, dataclasses.replace(sampling, n=1, temperature=0.0)).completions
    res = scored(greedy, list(range(len(prompts))), "greedy")
    out.update(_greedy(res.per_fn[correct_reward], res.total))
    per_reward = {name: _greedy(scores, scores) for name, scores in res.per_fn.items()}
    per_task = {t: _greedy([s for s, x in zip(res.per_fn[correct_reward], tasks) if x == t],
                           [s for s, x in zip(res.total, tasks) if x == t]) for t in dict.fromkeys(tasks)}
    if any("tool_calls" in c.meta for c in greedy):  # multi-turn: how often the greedy answers use a tool
        out["tool_call_frac"] = sum(c.meta["tool_calls"] > 0 for c in greedy) / len(greedy)
    if k > 1:
        sampled = generate(prompts, dataclasses.replace(sampling, n=k, temperature=temperature))
        of = sampled.group.tolist()
        res = scored(sampled.completions, of, "sampled")
        out.update(_sampled(of, res.per_fn[correct_reward], len(prompts), k))
        for name, scores in res.per_fn.items():
            per_reward[name].update(_sampled(of, scores, len(prompts), k))
        for t, figures in per_task.items():
            mine = [i for i, g in enumerate(of) if tasks[g] == t]
            index = {g: n for n, g in enumerate(dict.fromkeys(of[i] for i in mine))}
            figures.update(_sampled([index[of[i]] for i in mine], [res.per_fn[correct_reward][i] for i in mine],
                                    len(index), k))
    return Evaluation(out, per_reward, per_task, samples, len(prompts))


def _greedy(correct_scores: list[float], rewards: list[float]) -> dict[str, float]:
    return {"accuracy": sum(s >= 1.0 for s in correct_scores) / len(correct_scores),
            "reward": sum(rewards) / len(rewards)}


def _sampled(of: list[int], scores: list[float], prompts: int, k: int) -> dict[str, float]:
    """pass@1, pass@2 and pass@k, and mean@k, of `prompts` prompts' k samples each (sample i is of prompt of[i])."""
    hits = [0] * prompts
    for g, s in zip(of, scores):
        hits[g] += s >= 1.0
    out = {f"pass@{kk}": sum(pass_at_k(k, h, kk) for h in hits) / prompts
           for kk in sorted({1, 2, k} & set(range(1, k + 1)))}
    out[f"mean@{k}"] = sum(hits) / (k * prompts)
    return out


RESULTS_FILE = "eval_results.json"  # the final evaluation of `tandem train`, in run.output_dir


def results(evaluation: Evaluation, cfg) -> dict:
    """The evaluation as a results file (lm-eval-harness habits): the figures, per reward and per task, what was
    evaluated (model path, task, prompts, k, temperature) and the resolved config."""
    from tandem import __version__

    return {"model": cfg.model.path, "task": cfg.data.task, "prompts": evaluation.prompts, "k": cfg.eval.k,
            "temperature": cfg.eval.temperature, "results": evaluation.figures,
            "per_reward": evaluation.per_reward, "per_task": evaluation.per_task,
            "tandem_version": __version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": cfg.model_dump(mode="json")}


def write_json(path: str | Path, doc) -> Path:
    """`doc` as indented JSON at `path`, never half written (`_write_whole`)."""
    return _write_whole(path, json.dumps(doc, indent=2) + "\n")


def write_samples(path: str | Path, evaluation: Evaluation) -> Path:
    """Every evaluated completion as one JSON line: prompt index, task, question, greedy or sampled, the completion,
    its reward and each reward function's score."""
    return _write_whole(path, "".join(json.dumps(s) + "\n" for s in evaluation.samples))


def _write_whole(path: str | Path, text: str) -> Path:
    """`text` written beside `path` and renamed into place: a reader sees the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
