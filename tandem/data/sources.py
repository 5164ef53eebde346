"""Prompt sources: rows from jsonl, parquet, a `datasets` folder, GSM8K or the built-in task; prompts as token ids."""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from tandem.data import arithmetic


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
        rows, where = [], "line"
        with p.open() as f:
            for lineno, line in enumerate(f, 1):
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
    rows = read_rows(path, prompt_field, answer_field)
    out = []
    for r in rows:
        row = dict(r)
        row["question"], row["answer"] = str(r[prompt_field]), r[answer_field]
        if task == "gsm8k":
            try:
                row["answer"] = gsm8k_final_answer(str(r[answer_field]))
            except DataError as exc:
                raise DataError(f"{path}:{r.get('_line', '?')}: {exc}") from None
            row["question"] = f"{r[prompt_field]}\n{GSM8K_INSTRUCTION}"
        out.append(row)
    return out


def render_prompt(tokenizer, question: str, chat_template: bool, system_prompt: str) -> list[int]:
    """Prompt token ids: the raw question, or the tokenizer's chat template with the generation prompt opened."""
    if not chat_template:
        return tokenizer.encode(question, add_special_tokens=False)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data.chat_template: true, but the tokenizer has no chat template; set "
                        "data.chat_template=false (base models) or add a chat_template to tokenizer_config.json")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


@dataclass
class Prompt:
    ids: list[int]
    row: dict


def tokenize_rows(rows: list[dict], tokenizer, chat_template: bool, system_prompt: str, max_tokens: int,
                  source: str) -> list[Prompt]:
    prompts = []
    for i, row in enumerate(rows, 1):
        ids = render_prompt(tokenizer, row["question"], chat_template, system_prompt)
        if not ids:
            raise DataError(f"{source}:{row.get('_line', i)}: the prompt is empty after tokenization")
        if len(ids) > max_tokens:
            raise DataError(f"{source}:{row.get('_line', i)}: prompt has {len(ids)} tokens, over "
                            f"data.max_prompt_tokens={max_tokens}; raise the limit or drop the row")
        prompts.append(Prompt(ids, row))
    return prompts


class PromptStream:
    """Endless prompts in a reshuffled order each epoch; the position (epoch, index) is the whole state."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[Prompt]:
        out = []
        while len(out) < k:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)
