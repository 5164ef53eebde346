"""Raw rows from where users keep data: a jsonl/parquet file, a folder or a Hugging Face dataset id (subset, split)."""
from __future__ import annotations

import difflib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator


class DataError(ValueError):
    """Data, or a data setting, that tandem cannot use; the message says where and how to fix it."""


# A Hugging Face dataset id as the Hub names datasets: `namespace/name`. A path that is not on disk is read as one
# only in this shape (`gsm8k` alone, a typo'd `data/train.jsonl`, are missing paths, not ids to look up).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")


def row_at(source: str, row: dict, i: int) -> str:
    """Where a row is, for messages: `file:line` (1-based), `dataset row N` (0-based: `dataset[N]`), else `source:i`."""
    if "_line" in row:
        return f"{source}:{row['_line']}"
    if "_row" in row:
        return f"{source} row {row['_row']}"
    return f"{source}:{i}"


@dataclass
class Source:
    """A data source as opened: a file or one saved dataset (`splits` empty: one set of rows), or a dataset with
    named splits (a Hugging Face dataset id, a folder `datasets.load_dataset` reads, a saved `DatasetDict`)."""
    path: str
    setting: str  # the config field that names it (data.path, data.eval_path), for messages
    read: Callable[[str], list[dict]]  # a split's rows (the split is ignored where there are none)
    subset: str = ""
    splits: list[str] = field(default_factory=list)

    def name(self, split: str = "") -> str:
        """The source as messages name it: the path, with the subset and split where it has them."""
        if not self.splits:
            return self.path
        subset = f"subset {self.subset!r}, " if self.subset else ""
        return f"{self.path} ({subset}split {split!r})"

    @property
    def folder(self) -> Path | None:
        """What a row's relative file paths (its images) are relative to: a data file's folder, a dataset folder
        itself; None for a Hugging Face dataset id, which has no folder here."""
        path = Path(self.path).expanduser().absolute()
        return path.parent if path.is_file() else path if path.is_dir() else None

    def check_split(self, split: str, setting: str) -> None:
        """Refuse a split the source lacks, naming the ones it has."""
        if split not in self.splits:
            raise DataError(f"{setting}: {split!r} is not a split of {self.path!r}"
                            f"{f' (subset {self.subset!r})' if self.subset else ''}; its splits: "
                            f"{', '.join(self.splits)}{_suggest(split, self.splits)}")


def open_source(path: str, subset: str, setting: str) -> Source:
    """`path` opened, its subset checked and its splits known; rows are read later (`source_rows`). A local file or
    folder is taken first; a path that is on no disk and has the form `namespace/name` is a Hugging Face dataset id."""
    p = Path(path).expanduser()
    if p.is_file():
        _refuse_subset(path, subset, setting, "a file")
        return Source(path, setting, lambda _: _parquet_rows(p) if p.suffix == ".parquet" else _jsonl_rows(path))
    if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
        return _open_saved(path, p, subset, setting)
    if p.is_dir():
        return _open_with_load_dataset(path, str(p), subset, setting, hub=False)
    if HUB_ID.fullmatch(path) and not path.endswith(FILE_SUFFIXES):
        return _open_with_load_dataset(path, path, subset, setting, hub=True)
    raise DataError(f"{setting}: {path!r} does not exist; give a .jsonl/.parquet file, a dataset folder, or a "
                    "Hugging Face dataset id (namespace/name, e.g. openai/gsm8k)")


def read_rows(path: str, prompt_field: str, answer_field: str, split: str = "train", subset: str = "",
              setting: str = "data.path") -> list[dict]:
    """The rows of `path` (of its `split` and `subset`, where it has them), each checked for both fields."""
    source = open_source(path, subset, setting)
    if source.splits:
        source.check_split(split, "data.eval_split" if setting == "data.eval_path" else "data.split")
    return source_rows(source, split, prompt_field, answer_field)


def source_rows(source: Source, split: str, prompt_field: str, answer_field: str) -> list[dict]:
    """The rows of `source`'s `split` (ignored where it has no splits), each checked for both fields: a row
    without one is refused with where it is (`file:line`, or the dataset's split and row index)."""
    rows = source.read(split)
    where = source.name(split)
    if not rows:
        raise DataError(f"{source.setting}: {where!r} is empty; it needs at least one row with {prompt_field!r} and "
                        f"{answer_field!r}")
    for i, row in enumerate(rows, 1):
        for name in (prompt_field, answer_field):
            value = row.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                have = sorted(k for k, v in row.items() if v is not None and k not in ("_line", "_row"))
                at = f"{row_at(where, row, i)} (line {row['_line']})" if "_line" in row else row_at(where, row, i)
                raise DataError(f"{at}: missing field {name!r} (row has {have}); set "
                                f"data.{'prompt' if name == prompt_field else 'answer'}_field to the right name")
    return rows


def _indexed(dataset) -> list[dict]:
    """A `datasets.Dataset`'s rows, each with its index (`_row`, as `dataset[i]`) for messages. Images stay as the
    table holds them, `{"bytes", "path"}` (tandem.data.images reads them without decoding every pixel)."""
    rows = dataset.with_format("arrow")[:].to_pylist() if _holds_images(dataset) else dataset
    return [dict(row, _row=i) for i, row in enumerate(rows)]


def _holds_images(dataset) -> bool:
    """Whether a column is an Image feature, or a list of them (what `datasets` decodes to PIL row by row)."""
    from datasets import Image

    return any(isinstance(f, Image) or isinstance(getattr(f, "feature", None), Image)
               for f in dataset.features.values())


def _parquet_rows(path: Path) -> list[dict]:
    import datasets

    return _indexed(datasets.Dataset.from_parquet(str(path)))


def _jsonl_rows(path: str) -> list[dict]:
    """The JSON objects of a jsonl file, each with its line number (`_line`); blank lines skipped."""
    rows, offset = [], 0
    with Path(path).expanduser().open("rb") as f:
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
    return rows


def _refuse_subset(path: str, subset: str, setting: str, what: str) -> None:
    if subset:
        subset_setting = "data.eval_subset" if setting == "data.eval_path" else "data.subset"
        raise DataError(f"{subset_setting}: {subset!r}, but {setting} {path!r} is {what}, which has no subsets; "
                        f"remove {subset_setting}")


def _open_saved(path: str, folder: Path, subset: str, setting: str) -> Source:
    """A `datasets.save_to_disk` folder: one dataset (no splits), or a DatasetDict's splits."""
    import datasets

    _refuse_subset(path, subset, setting, "a save_to_disk folder")
    saved = datasets.load_from_disk(str(folder))
    if isinstance(saved, datasets.Dataset):
        return Source(path, setting, lambda _: _indexed(saved))
    return Source(path, setting, lambda split: _indexed(saved[split]), splits=list(saved))


def _open_with_load_dataset(path: str, where: str, subset: str, setting: str, hub: bool) -> Source:
    """A folder `datasets.load_dataset` reads (data files split by their names, or a dataset repository's README
    `configs`), or a Hugging Face dataset id: its subset checked, its splits listed from its data files before
    anything beyond its metadata is downloaded."""
    import datasets

    subset_setting = "data.eval_subset" if setting == "data.eval_path" else "data.subset"
    with _datasets_errors(path, setting, hub):
        subsets = datasets.get_dataset_config_names(where)
        if subset and subset not in subsets:
            raise DataError(f"{subset_setting}: {subset!r} is not a subset of {path!r}; its subsets: "
                            f"{', '.join(subsets)}{_suggest(subset, subsets)}")
        if not subset and len(subsets) > 1 and datasets.get_dataset_default_config_name(where) is None:
            raise DataError(f"{subset_setting}: empty, but {path!r} has several subsets and no default: "
                            f"{', '.join(subsets)}; name one ({subset_setting}={subsets[0]})")
        builder = datasets.load_dataset_builder(where, subset or None)
    splits = [str(s) for s in (builder.config.data_files or builder.info.splits or {})]

    def read_split(split: str) -> list[dict]:
        with _datasets_errors(path, setting, hub, builder.config.data_files):
            builder.download_and_prepare()  # every split, once: a second call finds them in the datasets cache
            return _indexed(builder.as_dataset(split=split))

    return Source(path, setting, read_split, subset=subset, splits=splits)


@contextmanager
def _datasets_errors(path: str, setting: str, hub: bool, data_files: dict | None = None) -> Iterator[None]:
    """What `datasets` raises reading a folder or a Hub id, said as a DataError naming the setting and the fix."""
    from datasets import config
    from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError
    from pyarrow import ArrowException

    local = (f"point {setting} at a local copy: a folder of its data files (e.g. `git clone "
             f"https://huggingface.co/datasets/{path}`), a jsonl/parquet file, or a save_to_disk folder")
    try:
        yield
    except ConnectionError:
        if not hub:
            raise
        offline = ("offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if config.HF_HUB_OFFLINE
                   else "the Hugging Face Hub cannot be reached")
        raise DataError(f"{setting}: {path!r} is no local file or folder, so it names a Hugging Face dataset, but "
                        f"{offline} and the dataset is not in the datasets cache ({config.HF_DATASETS_CACHE}); "
                        f"download it once where the Hub is reachable (offline mode off), or {local}") from None
    except DatasetNotFoundError as exc:
        raise DataError(f"{setting}: {path!r} is no local file or folder, and no dataset the Hugging Face Hub gives "
                        f"this machine ({exc}); check the id, log in (`hf auth login`) for a gated or private "
                        f"dataset, or {local}") from None
    except FileNotFoundError as exc:
        raise DataError(f"{setting}: {path!r} has no data files that `datasets` reads ({exc}); give a folder of "
                        "jsonl/json/parquet/csv files (named by split: train.jsonl, test.jsonl), a save_to_disk "
                        "folder, or a file") from None
    except (DatasetGenerationError, ArrowException) as exc:
        for files in (data_files or {}).values():  # a broken jsonl line: named by its file and line, as a file's
            for file in files:
                if file.endswith(".jsonl") and Path(file).is_file():
                    _jsonl_rows(file)
        cause = exc.__cause__ or exc
        raise DataError(f"{setting}: `datasets` could not read the files of {path!r} ({type(cause).__name__}: "
                        f"{cause}); check they are whole data files (a repository cloned without git-lfs holds "
                        "pointers to them)") from None


def _suggest(value: str, options: list[str]) -> str:
    near = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else ""
