"""Data as users keep it: dataset folders, Hugging Face dataset ids (offline), saved datasets; splits and subsets."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tandem.config import ConfigError, load_config
from tandem.data.sources import GSM8K_INSTRUCTION, DataError, load_prompts, load_task_rows, task_rows

GSM8K_ROWS = [{"question": f"Tom has {n} apples and buys {n} more. How many now?",
               "answer": f"{n} + {n} = <<{n}+{n}={2 * n}>>{2 * n}\n#### {2 * n:,}"} for n in (3, 40, 600, 7000)]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """The Hub out of reach, as HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 set it (the libraries read the variables
    when imported, so their flags are set too), and the datasets cache in the test's folder."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data(**settings) -> object:
    """The data section of a config with these data.* settings (task jsonl unless given)."""
    settings.setdefault("task", "jsonl")
    return load_config(None, [f"data.{k}={v}" for k, v in settings.items()]).data


def hub_layout(folder: Path, subsets: dict[str, dict[str, list[dict]]]) -> Path:
    """A dataset repository as the Hub keeps one (openai/gsm8k's layout): parquet files per subset and split, and a
    README whose `configs` name the subsets."""
    import datasets

    card = ["---", "configs:"]
    for subset, splits in subsets.items():
        card += [f"- config_name: {subset}", "  data_files:"]
        for split, rows in splits.items():
            (folder / subset).mkdir(parents=True, exist_ok=True)
            datasets.Dataset.from_list(rows).to_parquet(str(folder / subset / f"{split}-00000-of-00001.parquet"))
            card += [f"  - split: {split}", f"    path: {subset}/{split}-*"]
    (folder / "README.md").write_text("\n".join(card + ["---", "# a dataset"]) + "\n")
    return folder


def test_a_folder_of_split_files_trains_on_train_and_evaluates_on_test(tmp_path):
    folder = tmp_path / "arith"
    write_jsonl(folder / "train.jsonl", [{"q": "1+1", "a": "2"}, {"q": "2+2", "a": "4"}])
    write_jsonl(folder / "test.jsonl", [{"q": "3+3", "a": "6"}])
    rows = task_rows(data(path=folder, prompt_field="q", answer_field="a"))
    assert [(r["question"], r["answer"]) for r in rows.train] == [("1+1", "2"), ("2+2", "4")]
    assert [(r["question"], r["answer"]) for r in rows.held] == [("3+3", "6")]
    assert (rows.train_source, rows.held_source) == (f"{folder} (split 'train')", f"{folder} (split 'test')")
    # another split to train on; the held-out one named, and one other than the training split only
    rows = task_rows(data(path=folder, prompt_field="q", answer_field="a", split="test", eval_split="train"))
    assert [r["question"] for r in rows.train] == ["3+3"] and len(rows.held) == 2
    assert task_rows(data(path=folder, prompt_field="q", answer_field="a", split="test")).held is None


def test_validation_is_the_held_out_split_where_there_is_no_test(tmp_path):
    folder = tmp_path / "d"
    write_jsonl(folder / "train.jsonl", [{"question": "a", "answer": "1"}])
    write_jsonl(folder / "validation.jsonl", [{"question": "b", "answer": "2"}])
    rows = task_rows(data(path=folder))
    assert rows.held_source.endswith("(split 'validation')") and rows.held[0]["question"] == "b"


def test_splits_and_subsets_the_dataset_lacks_are_refused_listing_what_it_has(tmp_path):
    folder = hub_layout(tmp_path / "gsm8k", {s: {"train": GSM8K_ROWS[:2], "test": GSM8K_ROWS[2:]}
                                             for s in ("main", "socratic")})
    with pytest.raises(DataError, match=r"data\.subset: empty, but '.*gsm8k' has several subsets and no default: "
                                        r"main, socratic; name one \(data\.subset=main\)"):
        task_rows(data(task="gsm8k", path=folder))
    with pytest.raises(DataError, match=r"data\.subset: 'mian' is not a subset of '.*gsm8k'; its subsets: main, "
                                        r"socratic; did you mean 'main'\?"):
        task_rows(data(task="gsm8k", path=folder, subset="mian"))
    with pytest.raises(DataError, match=r"data\.split: 'tran' is not a split of '.*gsm8k' \(subset 'main'\); its "
                                        r"splits: train, test; did you mean 'train'\?"):
        task_rows(data(task="gsm8k", path=folder, subset="main", split="tran"))
    with pytest.raises(DataError, match=r"data\.eval_split: 'validation' is not a split of .*its splits: train, test"):
        task_rows(data(task="gsm8k", path=folder, subset="main", eval_split="validation"))


def test_gsm8k_from_a_hub_layout_folder_reads_as_the_official_files(tmp_path):
    folder = hub_layout(tmp_path / "gsm8k", {"main": {"train": GSM8K_ROWS[:3], "test": GSM8K_ROWS[3:]},
                                             "socratic": {"train": GSM8K_ROWS[:1], "test": GSM8K_ROWS[:1]}})
    rows = task_rows(data(task="gsm8k", path=folder, subset="main"))
    assert [r["answer"] for r in rows.train] == ["6", "80", "1200"] and [r["answer"] for r in rows.held] == ["14000"]
    assert rows.train[0]["question"] == f"{GSM8K_ROWS[0]['question']}\n{GSM8K_INSTRUCTION}"
    assert rows.held_source == f"{folder} (subset 'main', split 'test')"
    files = [write_jsonl(tmp_path / "official" / f"{s}.jsonl", r) for s, r in (("train", GSM8K_ROWS[:3]),
                                                                              ("test", GSM8K_ROWS[3:]))]
    from_files = [load_task_rows("gsm8k", str(f), "question", "answer", "train") for f in files]
    strip = lambda rs: [(r["question"], r["answer"]) for r in rs]  # noqa: E731
    assert (strip(rows.train), strip(rows.held)) == tuple(map(strip, from_files))


def test_gsm8k_official_files_as_a_dataset_folder(shared_dir, tmp_path):
    """The official files in a folder named by split (a dataset folder, as load_dataset reads it) give the same
    rows as the files themselves."""
    official = shared_dir / "data" / "gsm8k"
    if not (official / "train.jsonl").is_file():
        pytest.skip("shared/data/gsm8k not present")
    for split in ("train", "test"):  # the first 50 rows each: the same code reads all of them
        lines = (official / f"{split}.jsonl").read_text().splitlines(keepends=True)[:50]
        (tmp_path / "gsm8k").mkdir(exist_ok=True)
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text("".join(lines))
    rows = task_rows(data(task="gsm8k", path=tmp_path / "gsm8k"))
    files = [load_task_rows("gsm8k", str(tmp_path / "gsm8k" / f"{s}.jsonl"), "question", "answer", s)
             for s in ("train", "test")]
    assert [(r["question"], r["answer"]) for r in rows.train] == [(r["question"], r["answer"]) for r in files[0]]
    assert [r["answer"] for r in rows.held] == [r["answer"] for r in files[1]] and rows.held[0]["answer"] == "18"


def test_a_hub_id_out_of_reach_is_a_clear_error_not_a_traceback(tmp_path):
    with pytest.raises(DataError) as err:
        task_rows(data(task="gsm8k", path="openai/gsm8k", subset="main"))
    message = str(err.value)
    assert message.startswith("data.path: 'openai/gsm8k' is no local file or folder, so it names a Hugging Face "
                              "dataset, but offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"), message
    assert "git clone https://huggingface.co/datasets/openai/gsm8k" in message
    assert "point data.path at a local copy" in message
    with pytest.raises(DataError, match=r"data\.eval_path: 'someone/held-out' is no local file or folder"):
        task_rows(data(path=write_jsonl(tmp_path / "t.jsonl", GSM8K_ROWS), eval_path="someone/held-out"))
    # what is no id (a bare name, a file name) is a missing path, never looked up
    for path in ("gsm8k", "data/train.jsonl", str(tmp_path / "nothing")):
        with pytest.raises(DataError, match=rf"data\.path: '{path}' does not exist; give a \.jsonl/\.parquet file, "
                                            r"a dataset folder, or a Hugging Face dataset id \(namespace/name"):
            task_rows(data(path=path))


def test_a_dataset_the_hub_does_not_have_is_named_with_the_fix(monkeypatch):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def not_found(path, *args, **kwargs):
        raise DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "get_dataset_config_names", not_found)
    with pytest.raises(DataError, match=r"data\.path: 'openai/gsm8kk' is no local file or folder, and no dataset the "
                                        r"Hugging Face Hub gives this machine \(Dataset 'openai/gsm8kk' doesn't exist"
                                        r".*log in \(`hf auth login`\) for a gated or private dataset"):
        task_rows(data(path="openai/gsm8kk"))


def test_bad_rows_are_named_by_split_and_row_index_or_file_and_line(tmp_path, tiny_model):
    folder = tmp_path / "d"
    write_jsonl(folder / "train.jsonl", [{"question": "1+1", "answer": "2"}])
    write_jsonl(folder / "test.jsonl", [{"question": "1+1", "answer": "2"}, {"question": "2+2"}])
    with pytest.raises(DataError, match=r"d \(split 'test'\) row 1: missing field 'answer' \(row has \['question'\]\)"):
        task_rows(data(path=folder))
    (folder / "test.jsonl").write_text('{"question": "1+1", "answer": "2"}\n\n{"question": \n')
    with pytest.raises(DataError, match=r"d/test\.jsonl:3: not valid JSON"):  # datasets' own error says neither
        task_rows(data(path=folder))
    write_jsonl(folder / "test.jsonl", [{"question": "1+1", "answer": "2"}, {"question": "1+1" * 20, "answer": "2"}])
    from tandem.modeling import load_tokenizer

    with pytest.raises(DataError, match=r"d \(split 'test'\) row 1: prompt has \d+ tokens, over "
                                        r"data\.max_prompt_tokens=16"):
        load_prompts(data(path=folder, max_prompt_tokens=16), load_tokenizer(str(tiny_model)))


def test_saved_datasets_one_set_of_rows_or_a_dict_of_splits(tmp_path):
    import datasets

    rows = [{"question": "1+1", "answer": "2"}, {"question": "2+3", "answer": "5"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[1:])}).save_to_disk(str(tmp_path / "dict"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    got = task_rows(data(path=tmp_path / "dict"))
    assert len(got.train) == 2 and [r["question"] for r in got.held] == ["2+3"]
    with pytest.raises(DataError, match=r"data\.split: 'valid' is not a split of .*dict'; its splits: train, test"):
        task_rows(data(path=tmp_path / "dict", split="valid"))
    got = task_rows(data(path=tmp_path / "one"))
    assert len(got.train) == 2 and got.held is None
    with pytest.raises(DataError, match=r"data\.subset: 'main', but data\.path '.*one' is a save_to_disk folder, "
                                        r"which has no subsets; remove data\.subset"):
        task_rows(data(path=tmp_path / "one", subset="main"))


def test_a_file_has_no_splits_or_subsets(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1", "answer": "2"}])
    assert task_rows(data(path=path)).held is None
    with pytest.raises(DataError, match=r"data\.split: 'test', but data\.path '.*d\.jsonl' holds one set of rows, "
                                        r"with no splits; remove data\.split"):
        task_rows(data(path=path, split="test"))
    with pytest.raises(DataError, match=r"data\.eval_split: 'test', but data\.path '.*d\.jsonl' holds one set of "
                                        r"rows, with no splits; remove data\.eval_split, or set data\.eval_path"):
        task_rows(data(path=path, eval_split="test"))
    with pytest.raises(DataError, match=r"data\.subset: 'main', but data\.path '.*d\.jsonl' is a file"):
        task_rows(data(path=path, subset="main"))


def test_eval_path_takes_a_dataset_with_its_own_subset_and_split(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[:2])
    held = hub_layout(tmp_path / "held", {"easy": {"dev": GSM8K_ROWS[2:3]}, "hard": {"dev": GSM8K_ROWS[3:]}})
    rows = task_rows(data(task="gsm8k", path=train, eval_path=held, eval_subset="hard"))
    assert [r["answer"] for r in rows.held] == ["14000"] and rows.held_source == f"{held} (subset 'hard', split 'dev')"
    with pytest.raises(DataError, match=r"data\.eval_subset: empty, but '.*held' has several subsets"):
        task_rows(data(task="gsm8k", path=train, eval_path=held))
    two = hub_layout(tmp_path / "two", {"default": {"dev": GSM8K_ROWS[:1], "other": GSM8K_ROWS[:1]}})
    with pytest.raises(DataError, match=r"data\.eval_split: empty, and data\.eval_path '.*two' has no test or "
                                        r"validation split; its splits: dev, other; name one"):
        task_rows(data(task="gsm8k", path=train, eval_path=two))


def test_settings_a_task_does_not_read_are_refused_with_the_config():
    with pytest.raises(ConfigError, match=r"data\.subset: main: data\.task=arithmetic generates its own training "
                                          r"and held-out prompts and reads no dataset"):
        load_config(None, ["data.subset=main"])
    with pytest.raises(ConfigError, match=r"data\.split: test, data\.eval_split: train: data\.task=multiply"):
        load_config(None, ["data.task=multiply", "data.split=test", "data.eval_split=train"])
    with pytest.raises(ConfigError, match=r"data\.eval_subset: hard, but data\.eval_path is empty"):
        load_config(None, ["data.task=jsonl", "data.path=x/y", "data.eval_subset=hard"])
    with pytest.raises(ConfigError, match=r"data\.split"):
        load_config(None, ["data.task=jsonl", "data.path=x/y", "data.split="])


def test_a_split_the_data_lacks_is_refused_before_models_load(tmp_path, tiny_model, monkeypatch, capsys):
    from tandem import trainer
    from tandem.cli import main

    def build(*args, **kwargs):
        raise AssertionError("models loaded: the data settings should have been refused first")

    monkeypatch.setattr(trainer.placement, "build", build)
    folder = tmp_path / "d"
    write_jsonl(folder / "train.jsonl", [{"question": "1+1=", "answer": "2"}])
    write_jsonl(folder / "test.jsonl", [{"question": "2+2=", "answer": "4"}])
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tiny_model}\nrun:\n  output_dir: {tmp_path / 'out'}\n"
                   f"data:\n  task: jsonl\n  path: {folder}\n  split: training\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"data.split: 'training' is not a split of '{folder}'; its splits: train, test" in err, err


def test_a_dataset_with_a_test_split_is_evaluated_on_it_without_the_warning(tmp_path, tiny_model, caplog):
    from tandem.modeling import load_tokenizer

    folder = tmp_path / "d"
    write_jsonl(folder / "train.jsonl", [{"question": "1+1=", "answer": "2"}, {"question": "1+2=", "answer": "3"}])
    write_jsonl(folder / "test.jsonl", [{"question": "2+2=", "answer": "4"}])
    tokenizer = load_tokenizer(str(tiny_model))
    with caplog.at_level(logging.INFO, logger="tandem.data"):
        train, held = load_prompts(data(path=folder), tokenizer)
    assert len(train) == 2 and [p.row["question"] for p in held] == ["2+2="]
    assert "no held-out data" not in caplog.text and f"held-out prompts: {folder} (split 'test')" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem.data"):
        train, held = load_prompts(data(path=folder / "train.jsonl"), tokenizer)
    assert held == train and "no held-out data: data.eval_path is empty" in caplog.text
