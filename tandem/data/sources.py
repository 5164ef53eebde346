"""Prompt sources: a run's training and held-out rows, shaped for its task (GSM8K, built-in ones); prompts as ids."""
from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tandem.data import arithmetic, colors, long_tail, multiply
from tandem.data.images import attach_images, content_text, parts_problem, refuse_image_rows
from tandem.data.rows import DataError, Source, open_source, read_rows, row_at, source_rows

if TYPE_CHECKING:
    from tandem.config import DataConfig

log = logging.getLogger("tandem.data")

GSM8K_INSTRUCTION = "Solve the problem. Put the final numeric answer after '####'."
# generated, with a held-out split
BUILT_IN_TASKS = {"arithmetic": arithmetic.rows, "multiply": multiply.rows, "colors": colors.rows,
                  "long_tail": long_tail.rows}
HELD_OUT_SPLITS = ("test", "validation")  # where a dataset's held-out rows are, in the order they are looked for


@dataclass
class TaskRows:
    """A run's rows for its task: training ones and held-out ones (None: there are none, and evaluation takes the
    first training prompts), each with the name messages give their source."""
    train: list[dict]
    train_source: str
    held: list[dict] | None
    held_source: str


def task_rows(d: DataConfig) -> TaskRows:
    """The training rows (`data.path`, its `split` and `subset`) and the held-out ones: `data.eval_path`'s, else
    `data.path`'s `eval_split` (empty: its test, else validation split), else none. Every setting is checked
    against what the data has (splits, subsets) before a row is read."""
    if d.task in BUILT_IN_TASKS:
        train, held = BUILT_IN_TASKS[d.task]("train"), BUILT_IN_TASKS[d.task]("test")
        for rows in (train, held):  # the colors task's images, as a file's would be (bytes: no folder needed)
            attach_images(rows, "images", None, d.max_pixels, d.task)
        return TaskRows(train, d.task, held, d.task)
    source = open_source(d.path, d.subset, "data.path")
    if source.splits:
        source.check_split(d.split, "data.split")
    elif d.split != "train":
        raise DataError(f"data.split: {d.split!r}, but data.path {d.path!r} holds one set of rows, with no splits; "
                        "remove data.split, or point data.path at a dataset with splits")
    held_at = _held_out(d, source)
    train = _shaped(d, source, d.split)
    if held_at is None:
        return TaskRows(train, source.name(d.split), None, "")
    held_source, split = held_at
    return TaskRows(train, source.name(d.split), _shaped(d, held_source, split), held_source.name(split))


def _shaped(d: DataConfig, source: Source, split: str) -> list[dict]:
    """The split's rows shaped for the task, their images (`data.image_field`) read and checked."""
    rows = shape_rows(d.task, source_rows(source, split, d.prompt_field, d.answer_field), d.prompt_field,
                      d.answer_field, source.name(split))
    attach_images(rows, d.image_field, source.folder, d.max_pixels, source.name(split))
    return rows


def _held_out(d: DataConfig, train: Source) -> tuple[Source, str] | None:
    """Where the held-out rows are (a source and its split), checked; None where there are none."""
    if d.eval_path:
        source = open_source(d.eval_path, d.eval_subset, "data.eval_path")
        if not source.splits:
            _refuse_eval_split(d, "data.eval_path")
            return source, ""
        only = source.splits[0] if len(source.splits) == 1 else ""
        split = d.eval_split or _held_out_split(source.splits, "") or only
        if not split:
            raise DataError(f"data.eval_split: empty, and data.eval_path {d.eval_path!r} has no "
                            f"{' or '.join(HELD_OUT_SPLITS)} split; its splits: {', '.join(source.splits)}; name one")
        source.check_split(split, "data.eval_split")
        return source, split
    if not train.splits:
        _refuse_eval_split(d, "data.path")
        return None
    if d.eval_split:
        train.check_split(d.eval_split, "data.eval_split")
        return train, d.eval_split
    split = _held_out_split(train.splits, d.split)
    return (train, split) if split else None


def _held_out_split(splits: list[str], training: str) -> str:
    """The dataset's held-out split (test, else validation) other than the training one; empty if none."""
    return next((s for s in HELD_OUT_SPLITS if s in splits and s != training), "")


def _refuse_eval_split(d: DataConfig, setting: str) -> None:
    if d.eval_split:
        path = d.eval_path if setting == "data.eval_path" else d.path
        raise DataError(f"data.eval_split: {d.eval_split!r}, but {setting} {path!r} holds one set of rows, with no "
                        f"splits; remove data.eval_split{'' if d.eval_path else ', or set data.eval_path'}")


def load_prompts(d: DataConfig, tokenizer, model_path: str = "",
                 render: Callable[[dict], list[int]] | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """The training prompts and the held-out ones, tokenized and checked (a bad row is named by where it is).
    `render`: a vision-language model's row -> ids (`tandem.run.vision.VisionPrompts.ids`: its processor, each image
    expanded into its tokens); without it rows with images are refused (`model_path` says whether the model is
    text-only)."""
    rows = task_rows(d)
    if render is None:
        refuse_image_rows(rows.train, rows.train_source, d.image_field, model_path)
        refuse_image_rows(rows.held or [], rows.held_source, d.image_field, model_path)
    train = tokenize_rows(rows.train, tokenizer, d.chat_template, d.system_prompt, d.max_prompt_tokens,
                          rows.train_source, d.overlong_prompts, render)
    if rows.held is None:
        log.warning("no held-out data: data.eval_path is empty and data.path %r has no %s split besides the one "
                    "trained on; evaluating on the first %d training prompts, which measures memorization as much as "
                    "skill (set data.eval_path)", d.path, " or ".join(HELD_OUT_SPLITS), len(train[: d.eval_size]))
        return train, train[: d.eval_size]
    if d.task not in BUILT_IN_TASKS:
        log.info("held-out prompts: %s", rows.held_source)
    return train, tokenize_rows(rows.held[: d.eval_size], tokenizer, d.chat_template, d.system_prompt,
                                d.max_prompt_tokens, rows.held_source, d.overlong_prompts, render)


def gsm8k_final_answer(answer_text: str) -> str:
    """The reference number of an official GSM8K answer: the text after '####', without thousands separators."""
    if "####" not in answer_text:
        raise DataError(f"GSM8K answer has no '####' final answer: {answer_text[-80:]!r}")
    return re.sub(r"[,$\s]", "", answer_text.split("####")[-1])


def load_task_rows(task: str, path: str, prompt_field: str, answer_field: str, split: str) -> list[dict]:
    """One split's rows for `task`: a built-in task's `split`, or the rows of `path` (its train split where it has
    splits), shaped by `shape_rows`. A run reads its data through `task_rows`, which takes every data setting."""
    if task in BUILT_IN_TASKS:
        return BUILT_IN_TASKS[task](split)
    return shape_rows(task, read_rows(path, prompt_field, answer_field), prompt_field, answer_field, path)


def shape_rows(task: str, rows: list[dict], prompt_field: str, answer_field: str, source: str) -> list[dict]:
    """Rows with `question` and `answer` (plus the source row's other fields) for `task`, checked; `source` names
    them in messages."""
    out = []
    for i, r in enumerate(rows, 1):
        row = dict(r)
        prompt = r[prompt_field]
        if isinstance(prompt, str):
            row["question"] = prompt
        else:  # chat messages: a reward is handed the last user turn as the prompt, the template sees them all
            problem = messages_problem(prompt)
            if problem:
                raise DataError(f"{row_at(source, r, i)}: field {prompt_field!r} must be a string or a list "
                                f"of chat messages ({{'role', 'content'}} dicts), got {problem}; set "
                                "data.prompt_field to the field holding the prompt")
            row["_messages"] = prompt
            row["question"] = next((content_text(m["content"]) for m in reversed(prompt) if m["role"] == "user"), "")
        row["answer"] = r[answer_field]
        limit = r.get("max_new_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise DataError(f"{row_at(source, r, i)}: field 'max_new_tokens' (this row's completion limit, "
                            f"at most rollout.max_new_tokens) must be a positive integer, got {limit!r}")
        if task == "gsm8k":
            try:
                row["answer"] = gsm8k_final_answer(str(r[answer_field]))
            except DataError as exc:
                raise DataError(f"{row_at(source, r, i)}: {exc}") from None
            if "_messages" not in row:  # chat messages are the user's own wording: used as they are
                row["question"] = f"{r[prompt_field]}\n{GSM8K_INSTRUCTION}"
        out.append(row)
    return out


def messages_problem(value) -> str:
    """What keeps `value` from being chat messages (a non-empty list of dicts with a string role, and a content
    that is a string or a list of text and image parts), said as the error's `got ...`; empty if they are."""
    if not isinstance(value, list):
        return type(value).__name__
    if not value:
        return "an empty list"
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            return f"a list holding {type(m).__name__}"
        if not isinstance(m.get("role"), str):
            return f"a list whose message {i} has no string 'role'"
        content = m.get("content")
        if isinstance(content, list):
            problem = parts_problem(content)
            if problem:
                return f"a list whose message {i} has {problem}"
        elif not isinstance(content, str):
            return f"a list whose message {i} has no string 'content' (nor a list of content parts)"
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
                  source: str, overlong: str = "error",
                  render: Callable[[dict], list[int]] | None = None) -> list[Prompt]:
    """Each row's prompt ids (with `render`, a vision-language model's: images expanded). A prompt over `max_tokens`
    is refused (`overlong="error"`) or dropped and counted in one warning (`"skip"`)."""
    prompts, skipped = [], []
    for i, row in enumerate(rows, 1):
        at = row_at(source, row, i)
        try:
            ids = render(row) if render is not None else \
                render_prompt(tokenizer, row.get("_messages") or row["question"], chat_template, system_prompt)
        except DataError as exc:
            raise DataError(f"{at}: {exc}") from None
        if not ids:
            raise DataError(f"{at}: the prompt is empty after tokenization")
        if len(ids) > max_tokens:
            if overlong == "skip":
                skipped.append(row.get("_line", row.get("_row", i)))
                continue
            raise DataError(f"{at}: prompt has {len(ids)} tokens, over data.max_prompt_tokens="
                            f"{max_tokens}; raise the limit, drop the row, or set data.overlong_prompts=skip")
        prompts.append(Prompt(ids, row))
    if skipped and not prompts:
        raise DataError(f"{source}: all {len(skipped)} prompts are over data.max_prompt_tokens={max_tokens}; "
                        "raise the limit")
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
        log.warning("%s: skipped %d of %d prompts over data.max_prompt_tokens=%d (%s %s)", source, len(skipped),
                    len(rows), max_tokens, "rows" if "_row" in rows[0] else "lines", shown)
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
