"""The config's `rewards`, `reward_pool` and `eval` sections: what scores a completion, the pool that runs the
scoring with time limits, and how held-out prompts are evaluated."""
from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import Field

from tandem.config.base import ConfigError, Section

# A judge's template fields besides the row's own: the prompt as the policy saw it, the completion (quoted: see
# tandem.rollout.judge.quote) and the row's reference answer. Stated here so a config is checked without the judge.
JUDGE_FIELDS = ("prompt", "completion", "reference")
# The most digits a judge's <score> number has before its point, and after it: a verdict is a small number in a
# stated range, and one of 39 digits is a float32 inf (the dtype a step's rewards train in).
VERDICT_DIGITS = 6
DEFAULT_SCORE_RANGE = (0.0, 1.0)  # the scores the default template asks for: 0 or 1


def template_fields(template: str, setting: str, fields: str = "") -> list[str]:
    """The field names `template` reads, in order. Anything but `{name}` is refused with a ConfigError naming
    `setting`, the field and the fields there are (`fields`, else the built-in ones and the rows'): malformed
    braces, positional fields, attribute or item access (which str.format would follow into any object) and
    conversions or format specs (which run the value's own __format__, and may nest fields)."""
    there = fields or ", ".join(f"{{{f}}}" for f in JUDGE_FIELDS) + " and the data's row fields (as {field})"
    rule = f"a judge's template takes field names only: {there}; a literal brace is written {{{{ or }}}}"
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"{setting}: {template[:120]!r} is not a template str.format reads ({exc}); {rule}") from None
    names = []
    for _, name, spec, conversion in parts:
        if name is None:  # literal text to the end
            continue
        shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if name == "" or name.isdigit():
            why = "is positional (the judge passes fields by name)"
        elif "." in name or "[" in name:
            base = name.split(".")[0].split("[")[0]
            why = f"reads {'an attribute' if '.' in name.split('[')[0] else 'an item'} of {{{base}}}; write {{{base}}}"
        elif conversion:
            why = f"converts it (!{conversion}); write {{{name}}}"
        elif spec:
            why = f"formats it (:{spec}); write {{{name}}}"
        else:
            names.append(name)
            continue
        raise ConfigError(f"{setting}: {shown} {why}; {rule}")
    return names


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
        "other field of the row; given as the user's turn of the judge's chat template where it has one. Field names "
        "only: malformed braces, positional fields ({0}, {}), attribute or item access ({prompt.x}, {row[0]}), "
        "conversions (!r) and format specs (:>10) are refused when the config loads, a field the data's rows lack "
        "when the data loads, both before any model loads; {{ and }} are literal braces. The completion enters "
        "quoted: its <score> tags and the judge tokenizer's special-token strings written with &lt; and &gt;, so "
        "that the policy can neither write the judge's verdict nor end its turn. Empty = "
        "tandem.rollout.judge.DEFAULT_TEMPLATE (grade against the reference, end with <score>1</score> or "
        "<score>0</score>).",
    )
    verdict: Literal["score", "answer"] = Field(
        "score", description="`name: judge` only: how the score is read from the judge's greedy output (what it "
        "generated, never its prompt). `score`: the number in its first <score>...</score> tag, of at most 6 digits "
        "before its point and 6 after, within `score_range`. `answer`: the judge answers the problem itself (a "
        "template without {completion}) and the completion scores 1 when its text, stripped, is the judge's "
        "output, stripped, else 0. An output the rule cannot read, or a score outside `score_range`, scores 0 and "
        "is counted (`judge/<reward>/unreadable`, and as a failing reward under reward_pool.max_error_rate).",
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
    score_range: tuple[float, float] = Field(
        DEFAULT_SCORE_RANGE, description="`name: judge`, `verdict: score` only: the lowest and the highest score "
        "[low, high] the template asks for (the default template's 0 or 1; [0, 10] for a template grading 0-10). A "
        "verdict outside it, or a <score> number of more than 6 digits before its point or after it, scores 0 and "
        "is counted (`judge/<reward>/unreadable`), never clipped.",
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
