"""`rewards: [{name: judge, path: ..., template: ...}]`: a generative judge, a causal LM on a rollout engine that reads
each sample through a template and writes a verdict, which a stated rule turns into the sample's score."""
from __future__ import annotations

import functools
import re
import string
import time
from typing import Any, Iterable, Mapping, Sequence

from tandem.config import ConfigError
from tandem.config.scoring import DEFAULT_SCORE_RANGE, JUDGE_FIELDS, VERDICT_DIGITS, template_fields
from tandem.rollout.base import RolloutEngine, Sampling

NAME = "judge"  # the reward's name in `rewards:`

# The template's fields (JUDGE_FIELDS): the prompt as the policy saw it (its last user turn for a chat), the
# completion (quoted: `quote`), and the row's reference answer (its `answer` field; empty where the row has none).
# Any other {field} is the row's. Field names only: `template_fields` refuses the rest.
DEFAULT_TEMPLATE = (
    "Problem:\n{prompt}\n\nReference answer:\n{reference}\n\nResponse:\n{completion}\n\n"
    "Is the response's answer correct? End with <score>1</score> if it is, <score>0</score> if it is not.")

# How a verdict is read from the judge's output (greedy, at most max_new_tokens):
# - `score`: the number in the first <score>...</score> tag, as the score, within the judge's score_range (a judge
#   grading 0-1, 0-10, ...);
# - `answer`: the judge answered the problem itself (a template without {completion}): 1 when the completion's
#   text, stripped, is the judge's output, stripped, else 0 (a stronger model as the reference, for tasks whose
#   answers are short and canonical).
VERDICTS = ("score", "answer")
SCORE_TAG = re.compile(r"<score>(.*?)</score>", re.DOTALL)
_D = VERDICT_DIGITS
SCORE_NUMBER = re.compile(rf"\s*([-+]?(?:\d{{1,{_D}}}(?:\.\d{{0,{_D}}})?|\.\d{{1,{_D}}}))\s*")
# What a completion may not carry into the judge's prompt as is: a score tag, whatever its case and spacing.
TAG_LIKE = r"<\s*/?\s*score\b[^<>]*>"


class UnreadableVerdict(ValueError):
    """The judge's output holds no verdict the rule can read: the sample scores 0 and is counted."""


class VerdictOutOfRange(UnreadableVerdict):
    """The judge's score lies outside its score_range: the sample scores 0 and is counted, as unreadable."""


def read_verdict(rule: str, output: str, completion: str,
                 score_range: tuple[float, float] = DEFAULT_SCORE_RANGE) -> float:
    """The score the judge's `output` gives `completion` under `rule` (see VERDICTS); under `score`, a number of at
    most VERDICT_DIGITS digits before and after its point, within `score_range`."""
    if rule == "score":
        found = SCORE_TAG.search(output)
        if found is None:
            raise UnreadableVerdict(f"no <score>number</score> in the judge's output {output[:200]!r}")
        number = SCORE_NUMBER.fullmatch(found.group(1))
        if number is None:
            raise UnreadableVerdict(f"the judge's first <score> tag holds {found.group(1)[:60]!r}, not a number of "
                                    f"at most {_D} digits before its point and {_D} after")
        value, (low, high) = float(number.group(1)), score_range
        if not low <= value <= high:
            raise VerdictOutOfRange(f"the judge's score {value:g} is outside score_range [{low:g}, {high:g}] (the "
                                    "scores its template asks for): scored 0, not clipped")
        return value
    if rule == "answer":
        if not output.strip():
            raise UnreadableVerdict("the judge's output is empty: it gave no answer to compare with")
        return float(completion.strip() == output.strip())
    raise ValueError(f"verdict: {rule!r}; choose one of {', '.join(VERDICTS)}")


def special_strings(tokenizer: Any) -> list[str]:
    """The strings the judge's tokenizer reads as special tokens wherever they stand in a text (its special tokens,
    and added tokens marked special): a completion holding one could end the judge's turn and write its own."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(added.content))
    return sorted((s for s in found if s), key=len, reverse=True)


def quoting(specials: Iterable[str]) -> re.Pattern:
    """What `quote` escapes: score tags and the given special-token strings (the longest first)."""
    return re.compile("|".join([TAG_LIKE, *map(re.escape, specials)]), re.IGNORECASE)


def _escaped(found: re.Match) -> str:
    """A tag or special-token string written visibly as text: its angle brackets as &lt; &gt; (or, without any,
    its first character as a character reference), which no tokenizer reads as the token, nor a verdict as a tag."""
    s = found.group(0)
    if "<" in s or ">" in s:
        return s.replace("<", "&lt;").replace(">", "&gt;")
    return f"&#{ord(s[0])};{s[1:]}"


def quote(text: str, pattern: re.Pattern) -> str:
    """`text` (what the policy wrote) with every match of `pattern` (`quoting`) escaped, so that a score tag or a
    special token in it cannot pass for the judge's own."""
    out = pattern.sub(_escaped, text)
    if pattern.search(out):  # an escape that formed a new token: refuse this sample rather than pass it on
        raise ValueError("the completion holds a special token or score tag that cannot be escaped")
    return out


def render(template: str, completion: str, prompt: str, row: Mapping, quoted: re.Pattern | None = None) -> str:
    """The judge's text for one sample: `template`'s literal text with its fields, by name only, filled in (the
    completion quoted with `quoted`, default `quoting(())`); a field the row lacks raises KeyError, which fails
    that sample alone."""
    fields = {k: v for k, v in row.items() if isinstance(k, str) and not k.startswith("_")}
    fields.update(prompt=prompt, completion=quote(completion, quoted or quoting(())),
                  reference=str(row.get("answer", "")))
    return "".join(literal + ("" if name is None else str(fields[name])) for literal, name in _parts(template))


@functools.lru_cache(maxsize=16)
def _parts(template: str) -> tuple[tuple[str, str | None], ...]:
    """`template` as (literal text, field name or None) pairs, checked to be field names only (`template_fields`,
    whoever built the judge: never str.format's lookups); parsed once per template, not once per sample."""
    template_fields(template, "template")
    return tuple((literal, name) for literal, name, _, _ in string.Formatter().parse(template))


class Judge:
    """A batched reward `(completions, prompts, rows) -> scores` whose verdicts a causal LM on `engine` writes.

    Each sample's text is `template` rendered (`render`), as the user's turn of the judge's chat template where its
    tokenizer has one, else as plain text; a call's distinct texts go to the engine as one greedy generate call of
    at most `max_new_tokens` tokens each (the engine batches them: continuous batching on vLLM, padded rows on hf),
    so a text rendered for several samples (a group's, where the template leaves the completion out) is judged
    once.
    The completion enters the text quoted (`quote`): its score tags and the judge tokenizer's special-token strings
    escaped, so that what the policy wrote can neither pass for a verdict nor end the judge's turn. The verdict is
    read from what the judge generated alone (the engine's completion text, never the prompt).
    A verdict the rule cannot read, or a score outside `score_range`, fails that sample alone: its place holds an
    `UnreadableVerdict`, which the scorer counts as `raised` and scores 0, and `judge/<reward>/unreadable` counts
    it."""

    def __init__(self, engine: RolloutEngine, tokenizer, *, template: str = DEFAULT_TEMPLATE, verdict: str = "score",
                 max_new_tokens: int = 64, score_range: tuple[float, float] = DEFAULT_SCORE_RANGE):
        if verdict not in VERDICTS:
            raise ValueError(f"verdict: {verdict!r}; choose one of {', '.join(VERDICTS)}")
        _parts(template)  # raises a ConfigError (a ValueError) naming what is wrong
        self.engine, self.tokenizer = engine, tokenizer
        self.template, self.verdict, self.max_new_tokens = template, verdict, int(max_new_tokens)
        self.score_range = (float(score_range[0]), float(score_range[1]))
        self.quoted = quoting(special_strings(tokenizer))
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
                ids[i] = self.encode(render(self.template, c, p, r, self.quoted))
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
                scores.append(read_verdict(self.verdict, text, c, self.score_range))
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


def check_fields(specs: Sequence[Any], rows: Mapping[str, Sequence[Mapping]]) -> None:
    """Refuse, when the data has loaded and before any model loads, a judge's template naming a field that a row it
    would score lacks (`rows`: each data set's rows by what it is, "training", "held-out"): that row would fail on
    every sample. The message names the setting, the field, the row and the fields there are."""
    for i, spec in enumerate(specs):
        if getattr(spec, "name", None) != NAME:
            continue
        names = [n for n in template_fields(spec.template, f"rewards[{i}].template") if n not in JUDGE_FIELDS]
        for what, data in rows.items() if names else ():
            for k, row in enumerate(data, 1):
                missing = next((n for n in names if n not in row or n.startswith("_")), None)
                if missing is None:
                    continue
                at = f"row {k}" + (f" (line {row['_line']})" if "_line" in row else "")
                have = [f"{{{f}}}" for f in JUDGE_FIELDS] + sorted(
                    f"{{{f}}}" for f in row if isinstance(f, str) and not f.startswith("_") and f not in JUDGE_FIELDS)
                raise ConfigError(f"rewards[{i}].template: {{{missing}}} is not a field of the {what} data's {at}; "
                                  f"the fields there: {', '.join(have)}. Name one of them, or add {missing!r} to "
                                  "every row")


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
                 verdict=spec.verdict, max_new_tokens=spec.max_new_tokens, score_range=tuple(spec.score_range))
