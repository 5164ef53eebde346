"""Prompt sources: rows from jsonl, parquet, a `datasets` folder, GSM8K or the built-in task; prompts as token ids."""
from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path

from tandem.data import arithmetic, multiply

log = logging.getLogger("tandem.data")


class DataError(ValueError):
    pass


GSM8K_INSTRUCTION = "Solve the problem. Put the final numeric answer after '####'."


def read_rows(path: str, prompt_field: str, answer_field: str) -> list[dict]:
    """Rows of a .jsonl / .parquet file or a `datasets.save_to_disk` folder, each checked for both fields."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data: {path!r} does not exist")
    if p.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"data: {path!r} holds splits {list(ds)}; point at one split's folder")
        rows, where = list(ds), "row"
    elif p.suffix == ".parquet":
        import datasets

        rows, where = list(datasets.Dataset.from_parquet(str(p))), "row"
    else:
        rows, where, offset = [], "line", 0
        with p.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not UTF-8: byte 0x{raw[exc.start]:02x} at byte offset "
                                    f"{offset + exc.start} (column {exc.start + 1}); re-encode the file as UTF-8 "
                                    "(e.g. `iconv -f latin1 -t utf-8`)") from None
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                row["_line"] = lineno
                rows.append(row)
    if not rows:
        raise DataError(f"data: {path!r} is empty; it needs at least one row with {prompt_field!r} and {answer_field!r}")
    for i, row in enumerate(rows, 1):
        at = row.get("_line", i)
        for field in (prompt_field, answer_field):
            if field not in row or row[field] is None or (isinstance(row[field], str) and not row[field].strip()):
                have = sorted(k for k in row if k != "_line")
                raise DataError(f"{path}:{at} ({where} {at}): missing field {field!r} (row has {have}); "
                                f"set data.{'prompt' if field == prompt_field else 'answer'}_field to the right name")
    return rows


def gsm8k_final_answer(answer_text: str) -> str:
    """The reference number of an official GSM8K answer: the text after '####', without thousands separators."""
    if "####" not in answer_text:
        raise DataError(f"GSM8K answer has no '####' final answer: {answer_text[-80:]!r}")
    return re.sub(r"[,$\s]", "", answer_text.split("####")[-1])


def load_task_rows(task: str, path: str, prompt_field: str, answer_field: str, split: str) -> list[dict]:
    """Rows with `question` and `answer` (plus the source row's other fields) for the configured task."""
    if task == "arithmetic":
        return arithmetic.rows(split)
    if task == "multiply":
        return multiply.rows(split)
    rows = read_rows(path, prompt_field, answer_field)
    out = []
    for r in rows:
        row = dict(r)
        prompt = r[prompt_field]
        if isinstance(prompt, str):
            row["question"] = prompt
        else:  # chat messages: a reward is handed the last user turn as the prompt, the template sees them all
            problem = messages_problem(prompt)
            if problem:
                raise DataError(f"{path}:{r.get('_line', '?')}: field {prompt_field!r} must be a string or a list "
                                f"of chat messages ({{'role', 'content'}} dicts), got {problem}; set "
                                "data.prompt_field to the field holding the prompt")
            row["_messages"] = prompt
            row["question"] = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
        row["answer"] = r[answer_field]
        limit = r.get("max_new_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise DataError(f"{path}:{r.get('_line', '?')}: field 'max_new_tokens' (this row's completion limit, "
                            f"at most rollout.max_new_tokens) must be a positive integer, got {limit!r}")
        if task == "gsm8k":
            try:
                row["answer"] = gsm8k_final_answer(str(r[answer_field]))
            except DataError as exc:
                raise DataError(f"{path}:{r.get('_line', '?')}: {exc}") from None
            if "_messages" not in row:  # chat messages are the user's own wording: used as they are
                row["question"] = f"{r[prompt_field]}\n{GSM8K_INSTRUCTION}"
        out.append(row)
    return out


def messages_problem(value) -> str:
    """What keeps `value` from being chat messages (a non-empty list of dicts with string role and content),
    said as the error's `got ...`; empty if they are."""
    if not isinstance(value, list):
        return type(value).__name__
    if not value:
        return "an empty list"
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            return f"a list holding {type(m).__name__}"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"a list whose message {i} has no string {key!r}"
    return ""


def render_prompt(tokenizer, question: str | list[dict], chat_template: bool, system_prompt: str) -> list[int]:
    """Prompt token ids: the raw question, or the tokenizer's chat template with the generation prompt opened.
    Chat messages (a list) always go through the template: it is the only way to render them."""
    if not chat_template and isinstance(question, str):
        return tokenizer.encode(question, add_special_tokens=False)
    if not getattr(tokenizer, "chat_template", None):
        if isinstance(question, list):
            raise DataError("the prompt is chat messages, but the tokenizer has no chat template; add a "
                            "chat_template to tokenizer_config.json or give prompts as text")
        raise DataError("data.chat_template: true, but the tokenizer has no chat template; set "
                        "data.chat_template=false (base models) or add a chat_template to tokenizer_config.json")
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else list(question)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


@dataclass
class Prompt:
    ids: list[int]
    row: dict


def tokenize_rows(rows: list[dict], tokenizer, chat_template: bool, system_prompt: str, max_tokens: int,
                  source: str, overlong: str = "error") -> list[Prompt]:
    """Each row's prompt ids. A prompt over `max_tokens` is refused (`overlong="error"`) or dropped and counted
    in one warning (`"skip"`)."""
    prompts, skipped = [], []
    for i, row in enumerate(rows, 1):
        at = row.get("_line", i)
        try:
            ids = render_prompt(tokenizer, row.get("_messages") or row["question"], chat_template, system_prompt)
        except DataError as exc:
            raise DataError(f"{source}:{at}: {exc}") from None
        if not ids:
            raise DataError(f"{source}:{at}: the prompt is empty after tokenization")
        if len(ids) > max_tokens:
            if overlong == "skip":
                skipped.append(at)
                continue
            raise DataError(f"{source}:{at}: prompt has {len(ids)} tokens, over data.max_prompt_tokens="
                            f"{max_tokens}; raise the limit, drop the row, or set data.overlong_prompts=skip")
        prompts.append(Prompt(ids, row))
    if skipped and not prompts:
        raise DataError(f"{source}: all {len(skipped)} prompts are over data.max_prompt_tokens={max_tokens}; "
                        "raise the limit")
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
        log.warning("%s: skipped %d of %d prompts over data.max_prompt_tokens=%d (lines %s)", source, len(skipped),
                    len(rows), max_tokens, shown)
    return prompts


class PromptStream:
    """Endless prompts in a reshuffled order each epoch; the position (epoch, index) is the state, with the prompts
    to sample again before going on (`redo`: a streaming run's groups that were in flight, or dropped as stale)."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed
        self.epoch, self.index = 0, 0
        self.redo: list[int] = []  # indices into `prompts`, taken first
        self._order = self._shuffled(0)
        self._index_of = {id(p): i for i, p in enumerate(prompts)}

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[Prompt]:
        out = []
        while self.redo and len(out) < k:
            out.append(self.prompts[self.redo.pop(0)])
        while len(out) < k:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def index_of(self, prompt: Prompt) -> int:
        """`prompt`'s index in `prompts` (one this stream gave out)."""
        return self._index_of[id(prompt)]

    def state_dict(self, redo: list[Prompt] = ()) -> dict:
        """The position; with `redo`, prompts to sample again first (before the stream's own)."""
        state = {"epoch": self.epoch, "index": self.index}
        again = [self.index_of(p) for p in redo] + self.redo
        if again:
            state["redo"] = again
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self.redo = list(state.get("redo", []))
        self._order = self._shuffled(self.epoch)
