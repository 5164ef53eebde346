"""`rewards: [{name: judge, path: ..., template: ...}]`: a generative judge, a causal LM on a rollout engine that reads
each sample through a template and writes a verdict, which a stated rule turns into the sample's score."""
from __future__ import annotations

import re
import time
from typing import Any, Mapping, Sequence

from tandem.rollout.base import RolloutEngine, Sampling

NAME = "judge"  # the reward's name in `rewards:`

# The template's fields: the prompt as the policy saw it (its last user turn for a chat), the completion, and the
# row's reference answer (its `answer` field; empty where the row has none). Any other {field} is the row's.
DEFAULT_TEMPLATE = (
    "Problem:\n{prompt}\n\nReference answer:\n{reference}\n\nResponse:\n{completion}\n\n"
    "Is the response's answer correct? End with <score>1</score> if it is, <score>0</score> if it is not.")

# How a verdict is read from the judge's output (greedy, at most max_new_tokens):
# - `score`: the number in the first <score>...</score> tag, as the score (a judge grading 0-1, 0-10, ...);
# - `answer`: the judge answered the problem itself (a template without {completion}): 1 when the completion's
#   text, stripped, is the judge's output, stripped, else 0 (a stronger model as the reference, for tasks whose
#   answers are short and canonical).
VERDICTS = ("score", "answer")
SCORE_TAG = re.compile(r"<score>\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*</score>")


class UnreadableVerdict(ValueError):
    """The judge's output holds no verdict the rule can read: the sample scores 0 and is counted."""


def read_verdict(rule: str, output: str, completion: str) -> float:
    """The score the judge's `output` gives `completion` under `rule` (see VERDICTS)."""
    if rule == "score":
        found = SCORE_TAG.search(output)
        if found is None:
            raise UnreadableVerdict(f"no <score>number</score> in the judge's output {output[:200]!r}")
        return float(found.group(1))
    if rule == "answer":
        if not output.strip():
            raise UnreadableVerdict("the judge's output is empty: it gave no answer to compare with")
        return float(completion.strip() == output.strip())
    raise ValueError(f"verdict: {rule!r}; choose one of {', '.join(VERDICTS)}")


def render(template: str, completion: str, prompt: str, row: Mapping) -> str:
    """The judge's text for one sample: `template` with its fields filled (a field the row lacks raises KeyError,
    which fails that sample alone)."""
    fields = {k: v for k, v in row.items() if isinstance(k, str) and not k.startswith("_")}
    fields.update(prompt=prompt, completion=completion, reference=str(row.get("answer", "")))
    return template.format_map(fields)


class Judge:
    """A batched reward `(completions, prompts, rows) -> scores` whose verdicts a causal LM on `engine` writes.

    Each sample's text is `template` rendered (`render`), as the user's turn of the judge's chat template where its
    tokenizer has one, else as plain text; a call's distinct texts go to the engine as one greedy generate call of
    at most `max_new_tokens` tokens each (the engine batches them: continuous batching on vLLM, padded rows on hf),
    so a text rendered for several samples (a group's, where the template leaves the completion out) is judged
    once.
    A verdict the rule cannot read fails that sample alone: its place holds an `UnreadableVerdict`, which the scorer
    counts as `raised` and scores 0, and `judge/<reward>/unreadable` counts it."""

    def __init__(self, engine: RolloutEngine, tokenizer, *, template: str = DEFAULT_TEMPLATE, verdict: str = "score",
                 max_new_tokens: int = 64):
        if verdict not in VERDICTS:
            raise ValueError(f"verdict: {verdict!r}; choose one of {', '.join(VERDICTS)}")
        self.engine, self.tokenizer = engine, tokenizer
        self.template, self.verdict, self.max_new_tokens = template, verdict, int(max_new_tokens)
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self._last: dict[str, float] = {}

    def encode(self, text: str) -> list[int]:
        tok = self.tokenizer
        if self.chat:
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        return tok.encode(text, add_special_tokens=False)

    def outputs(self, completions: Sequence[str], prompts: Sequence[str], rows: Sequence[Mapping]) -> list[Any]:
        """The judge's output text for each sample (or the exception its rendering raised)."""
        out: list[Any] = [None] * len(completions)
        ids: dict[int, list[int]] = {}
        for i, (c, p, r) in enumerate(zip(completions, prompts, rows)):
            try:
                ids[i] = self.encode(render(self.template, c, p, r))
            except Exception as exc:  # that sample fails alone (the scorer counts it); the others are judged
                out[i] = exc
        distinct = list(dict.fromkeys(tuple(v) for v in ids.values()))  # a group's rows may render the same text
        if distinct:
            sampled = self.engine.generate([list(v) for v in distinct],
                                           Sampling(n=1, temperature=0.0, max_new_tokens=self.max_new_tokens))
            text = {v: c.text for v, c in zip(distinct, sampled)}
            for i, v in ids.items():
                out[i] = text[tuple(v)]
        return out

    def __call__(self, completions: list[str], prompts: list[str], rows: list[Mapping]) -> list[Any]:
        start = time.perf_counter()
        scores: list[Any] = []
        unreadable = 0
        for c, text in zip(completions, self.outputs(completions, prompts, rows)):
            if isinstance(text, BaseException):
                scores.append(text)
                continue
            try:
                scores.append(read_verdict(self.verdict, text, c))
            except UnreadableVerdict as exc:
                unreadable += 1
                scores.append(exc)
        self._last = {"seconds": time.perf_counter() - start, "samples": float(len(completions)),
                      "unreadable": float(unreadable)}
        return scores

    def metrics(self, key: str) -> dict[str, float]:
        """The last call's figures under the reward's metric name `key` (tandem.run.metric_names, "Judge")."""
        m = self._last
        return {f"time/judge/{key}": m.get("seconds", 0.0), f"judge/{key}/samples": m.get("samples", 0.0),
                f"judge/{key}/unreadable": m.get("unreadable", 0.0)}

    def close(self) -> None:
        """Stop the judge's engine (the scorer calls it when the run ends)."""
        self.engine.close()


def check(specs: Sequence[Any]) -> None:
    """Refuse, before any model loads, a `name: judge` reward whose path is not a whole local causal-LM folder."""
    from tandem.modeling import check_model_folder

    for i, spec in enumerate(specs):
        if getattr(spec, "name", None) == NAME:
            check_model_folder(spec.path, f"rewards[{i}].path (a judge)")


def make_judge(spec: Any, *, dtype: str, seed: int, device: str, kv_cache_bytes: int,
               trust_remote_code: bool = False) -> Judge:
    """The judge a config RewardSpec describes, on its engine (`spec.engine`): greedy, never asleep (a judge scores
    while the policy's engine sleeps), no prefix cache reset to care about (its weights never change)."""
    from tandem.modeling import load_tokenizer
    from tandem.rollout import make_engine

    kwargs: dict[str, Any] = dict(model_path=spec.path, dtype=dtype, seed=seed)
    if spec.engine == "hf":
        engine = make_engine("hf", **kwargs, trust_remote_code=trust_remote_code, device=device)
    else:
        engine = make_engine(spec.engine, **kwargs, kv_cache_bytes=kv_cache_bytes, enable_sleep=False)
    return Judge(engine, load_tokenizer(spec.path, trust_remote_code), template=spec.template or DEFAULT_TEMPLATE,
                 verdict=spec.verdict, max_new_tokens=spec.max_new_tokens)
