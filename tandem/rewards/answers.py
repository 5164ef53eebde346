"""Math answer rewards: GSM8K-style final numbers (pure Python) and LaTeX equivalence with math-verify."""
from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Mapping

from tandem.rewards.base import register_reward

# A number as people write it: optional sign, thousands groups (1,234,567) or plain digits, optional decimals,
# or a bare decimal (.5); then optionally a fraction denominator (3/4). `\u2212` is the typographic minus.
_NUM = r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?"
_NUM_RE = re.compile(rf"(?<![\w.]){_NUM}")  # not glued to a word (x2) or the tail of another number
_HASH_RE = re.compile(r"####")
_ANSWER_RE = re.compile(r"(?:the\s+)?(?:final\s+)?answer\s*(?:is|=|:)", re.IGNORECASE)
_A_COLON_RE = re.compile(r"(?m)^\s*A\s*:")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*)\}\s*\{\s*([^{}]*)\}")
_LATEX_NOISE_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}|\\[,;:! ]|\\left|\\right|\\\$|\\%|\$")


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def _clean_latex(text: str) -> str:
    text = text.replace("{,}", ",")  # LaTeX thousands separator 1{,}000
    text = _FRAC_RE.sub(r"\1/\2", text)
    return _LATEX_NOISE_RE.sub(" ", text)


def _first_number(text: str) -> str | None:
    m = _NUM_RE.search(_clean_latex(text))
    return _canonical(m.group(0)) if m else None


def _last_number(text: str) -> str | None:
    found = _NUM_RE.findall(_clean_latex(text))
    return _canonical(found[-1]) if found else None


def _canonical(raw: str) -> str:
    """`-1,234.50` -> `-1234.50`, `3 / 4` -> `3/4`: separators and spaces removed, nothing rounded."""
    return re.sub(r"[\s,]", "", raw.replace("\u2212", "-"))


def extract_number(text: str) -> str | None:
    """The final numeric answer of a solution, as a canonical string (`"1234"`, `"-0.5"`, `"3/4"`), or None.

    Looked for in this order, the first that holds a number wins: after the last `####` (GSM8K references),
    inside the last `\\boxed{}`, after the last "the answer is" / "answer:", after a line-leading "A:", and
    finally the last number in the text (inside the last `<answer>` tag when there is one). Thousands separators,
    currency signs, `%`, trailing units ("42 apples") and a sentence's trailing period are ignored.
    """
    if not text:
        return None
    positions = [m.end() for m in _HASH_RE.finditer(text)]
    if positions and (n := _first_number(text[positions[-1]:])) is not None:
        return n
    boxed = _last_boxed(text)
    if boxed is not None and (n := _first_number(boxed)) is not None:
        return n
    for pattern in (_ANSWER_RE, _A_COLON_RE):
        ends = [m.end() for m in pattern.finditer(text)]
        if ends:
            line = text[ends[-1]:].lstrip().split("\n", 1)[0]
            if (n := _first_number(line)) is not None:
                return n
    tags = _ANSWER_TAG_RE.findall(text)
    if tags and (n := _last_number(tags[-1])) is not None:
        return n
    return _last_number(text)


def to_fraction(number: str) -> Fraction | None:
    """A canonical number string (from `extract_number`) as an exact Fraction; None if it is not one."""
    try:
        if "/" in number:
            num, den = number.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(number)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str | None, b: str | None, rel_tol: float = 1e-6) -> bool:
    """Whether two number strings denote the same value: exactly, or within `rel_tol` (so `0.333333` = `1/3`)."""
    if a is None or b is None:
        return False
    fa, fb = to_fraction(_canonical(a)), to_fraction(_canonical(b))
    if fa is None or fb is None:
        return False
    if fa == fb:
        return True
    return abs(fa - fb) <= Fraction(rel_tol) * max(abs(fa), abs(fb))


@register_reward("gsm8k", inline=True)
def gsm8k(completion: str, prompt: str, row: Mapping, answer_key: str = "answer", rel_tol: float = 1e-6) -> float:
    """1.0 if the completion's final number equals the reference `row[answer_key]` (a number, or a full GSM8K
    solution ending in `#### 42`), else 0.0. A row without a readable reference number raises (counted as an error)."""
    ref = extract_number(str(row[answer_key]))
    if ref is None:
        raise ValueError(f"no number in the reference answer {str(row[answer_key])[:80]!r}")
    return float(numbers_equal(extract_number(completion), ref, rel_tol))


_mv = None


def _math_verify():
    """Import math-verify on first use (it pulls in sympy: about a second) and silence its "no timeout" warning:
    the pool enforces the time limit by killing the worker, which works from any thread, unlike its signal.alarm."""
    global _mv
    if _mv is None:
        import math_verify

        logging.getLogger("math_verify").setLevel(logging.ERROR)
        _mv = math_verify
    return _mv


def _as_latex_gold(gold: str) -> str:
    # A bare reference such as `\frac{1}{2}` or `42` has no delimiters for math-verify's LaTeX extractor to find.
    return gold if ("$" in gold or "\\boxed" in gold or "\\(" in gold or "\\[" in gold) else f"${gold}$"


def math_equal(prediction: str, gold: str) -> bool:
    """Whether the answer in `prediction` (last `\\boxed{}` first, then other LaTeX or plain expressions) is
    mathematically equal to `gold`, per math-verify. No time limit of its own: call it where the caller can kill it."""
    mv = _math_verify()
    gold_parsed = mv.parse(_as_latex_gold(gold), parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"math-verify could not parse the reference {gold[:80]!r}")
    pred_parsed = mv.parse(prediction, parsing_timeout=None)
    if not pred_parsed:
        return False
    return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=None))


@register_reward("math")
def math_reward(completion: str, prompt: str, row: Mapping, answer_key: str = "answer") -> float:
    """1.0 if the completion's answer is equivalent to `row[answer_key]` (LaTeX or plain) per math-verify, else 0.0.

    Runs in the pool (not inline): sympy can take unbounded time, and the pool's per-call limit kills it."""
    return float(math_equal(completion, str(row[answer_key])))


math_reward.warmup = _math_verify  # the pool calls this when a worker starts, outside any time limit
