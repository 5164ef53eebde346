"""The config's `rewards`, `reward_pool` and `eval` sections: what scores a completion, the pool that runs the
scoring with time limits, and how held-out prompts are evaluated."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tandem.config.base import Section


class RewardSpec(Section):
    name: str = Field(
        description="A registered reward (e.g. `arithmetic_exact`, `gsm8k`), a plugin `module:function`, `model` "
        "(a reward model: `path`), or `judge` (a generative judge: `path`, `template`, `verdict`, `engine`).",
    )
    weight: float = Field(
        1.0, allow_inf_nan=False, description="Weight in the summed reward. A weighted score that takes a sample's "
        "total beyond float32's range (about 3.4e38, the dtype a step's rewards train in) is that reward's "
        "`bad_value` error, scored 0, as a NaN or an inf score is.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the function.")
    path: str = Field(
        "", description="`name: model`: a local Hugging Face sequence-classification checkpoint with one output "
        "(a reward model, e.g. Skywork-Reward) that scores prompt + completion through its own tokenizer and chat "
        "template. It runs in the trainer's process, on the device only while it scores (`placement.offload`). "
        "`name: judge`: a local causal-LM folder, the judge.",
    )
    normalize: Literal["none", "sigmoid", "zscore"] = Field(
        "none", description="`name: model` only: what the model's output becomes before the weighted sum: `none` "
        "(the raw logit), `sigmoid` (in (0, 1)), `zscore` (minus the mean, over the std, of the scores of one "
        "scoring call: a step's batch; a group's under `placement.schedule: stream`).",
    )
    batch_tokens: int = Field(
        8192, ge=1, description="`name: model` only: the most tokens (rows x the longest, padding included) in one "
        "forward of the reward model; a longer text goes alone.",
    )
    template: str = Field(
        "", description="`name: judge` only: the judge's prompt, a Python format string of {prompt} (as the policy "
        "saw it: a chat's last user turn), {completion}, {reference} (the row's `answer`, empty without one) and any "
        "other field of the row; given as the user's turn of the judge's chat template where it has one. Empty = "
        "tandem.rollout.judge.DEFAULT_TEMPLATE (grade against the reference, end with <score>1</score> or "
        "<score>0</score>).",
    )
    verdict: Literal["score", "answer"] = Field(
        "score", description="`name: judge` only: how the score is read from the judge's greedy output. `score`: the "
        "number in its first <score>...</score> tag. `answer`: the judge answers the problem itself (a template "
        "without {completion}) and the completion scores 1 when its text, stripped, is the judge's output, "
        "stripped, else 0. An output the rule cannot read scores 0 and is counted (`judge/<reward>/unreadable`, "
        "and as a failing reward under reward_pool.max_error_rate).",
    )
    engine: Literal["hf", "vllm", "vllm_server"] = Field(
        "hf", description="`name: judge` only: what runs the judge, in the trainer's process: the embedded `hf` "
        "engine, vLLM in process (`vllm`), or a vLLM server tandem starts on loopback (`vllm_server`: its own "
        "process; a server that dies fails the samples it was judging, counted, and the run stops by "
        "reward_pool.max_error_rate). rollout.vllm.kv_cache_mb sizes a vLLM judge's KV cache.",
    )
    max_new_tokens: int = Field(
        64, ge=1, description="`name: judge` only: the longest verdict the judge may write (greedy).",
    )


class RewardPoolConfig(Section):
    timeout_s: float = Field(
        10.0, gt=0.0, description="Time limit of one reward call in the pool; a call past it scores 0 and is counted "
        "(reward/errors/<name>/timeout). A batched function's one call covers its batch.",
    )
    workers: int | None = Field(
        None, ge=0, description="Reward worker processes; None = one per core (at most 4); 0 = run every reward in "
        "the trainer process, without per-call time limits. Inline rewards (cheap built-ins) never use the pool.",
    )
    step_budget_s: float = Field(
        300.0, gt=0.0, description="Time for scoring one batch (a step's samples, or an evaluation's). When it runs "
        "out, the calls in flight are killed and every sample not scored yet scores 0, counted as "
        "reward/errors/<name>/budget; time/reward_budget_used is the share a step used. Inline rewards run first "
        "and are never interrupted, only not started. 300 s is far above what working rewards take (the demo's 256 "
        "samples score in well under a second) and far below the 21 minutes a reward that hangs on every sample "
        "would cost a demo-sized step (256 x timeout_s / 2 workers).",
    )
    max_error_rate: float = Field(
        0.5, ge=0.0, le=1.0, description="Stop the run when a reward fails (any kind, budget included) on more than "
        "this fraction of the samples of the steps so far, the last 3 at most; the error names the reward, its rate "
        "and its last error. reward/error_rate/<name> is each step's fraction. So step 1 is judged alone: a reward "
        "that cannot work (an import error, a missing row field, a hang) fails on ~100% from step 1 and stops the "
        "run there, before it trains on zeros. Later, one bad step among good ones passes (a step failing "
        "everywhere after one clean step is 50% of two steps, not above 0.5) and a second in a row stops the run; a "
        "few bad rows or timeouts are a few percent. 1 = never stop. Evaluation does not count.",
    )


class EvalConfig(Section):
    k: int = Field(
        1, ge=1, description="Samples per prompt for pass@k and mean@k (unbiased estimator); 1 = greedy only.",
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature for pass@k.")
