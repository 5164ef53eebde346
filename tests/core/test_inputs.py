"""Inputs that would otherwise be silently wrong (model folders, prompt values, encodings, long prompts) are named."""
from __future__ import annotations

import json
import logging
import re
import shutil
import struct

import pytest
import torch

from tandem.config import ConfigError, load_config
from tandem.data.sources import DataError, load_task_rows, tokenize_rows
from tandem.modeling import ModelFolderError, check_model_folder, load_causal_lm, load_tokenizer


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    """A writable copy of the tiny model, for a test to break."""
    return shutil.copytree(tiny_model, tmp_path / "model")


def test_model_folder_without_tokenizer_names_the_missing_files(model_copy):
    (model_copy / "tokenizer.json").unlink()
    (model_copy / "tokenizer_config.json").unlink()
    for check in (check_model_folder, load_tokenizer):  # today: an empty tokenizer, and later an empty prompt
        with pytest.raises(ModelFolderError, match=rf"{model_copy}.* no tokenizer.*tokenizer\.json.*vocab\.json \+ "
                                                   r"merges\.txt.*tokenizer\.model"):
            check(str(model_copy))
    (model_copy / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    with pytest.raises(ModelFolderError, match=r"no tokenizer.*found: config\.json, generation_config\.json"):
        check_model_folder(str(model_copy))
    (model_copy / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=rf"tokenizer in {model_copy} does not load"):
        load_tokenizer(str(model_copy))


@pytest.mark.parametrize("text, message", [
    ('{"model_type": "qwen2",\n', r"config\.json: not valid JSON at line 2 column 1"),
    ('["qwen2"]', r"config\.json: expected a JSON object, got list"),
    ('{"hidden_size": 32}', r"config\.json: no 'model_type'"),
])
def test_bad_config_json_is_named(model_copy, text, message):
    (model_copy / "config.json").write_text(text)
    with pytest.raises(ModelFolderError, match=message):
        check_model_folder(str(model_copy))
    with pytest.raises(ModelFolderError, match=message):
        load_causal_lm(str(model_copy))


def test_bad_safetensors_are_named_before_the_model_loads(model_copy):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1000])
    truncated = rf"model\.safetensors: truncated: its header says {len(data)} bytes, the file has {len(data) - 1000}"
    for check in (check_model_folder, load_causal_lm):  # the policy and the embedded engine load through the latter
        with pytest.raises(ModelFolderError, match=truncated):
            check(str(model_copy))

    from tandem.rollout.vllm.weights import _Checkpoint  # both vLLM engines read the checkpoint through it
    with pytest.raises(ModelFolderError, match=truncated):
        _Checkpoint(str(model_copy), torch.float32)

    weights.write_bytes(data[:5])
    with pytest.raises(ModelFolderError, match=r"model\.safetensors: 5 bytes, too short"):
        check_model_folder(str(model_copy))
    weights.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(ModelFolderError, match=r"model\.safetensors: truncated: its header alone says 1000000000008"):
        check_model_folder(str(model_copy))
    weights.write_bytes(struct.pack("<Q", 4) + b"nope" + data[8:])
    with pytest.raises(ModelFolderError, match=r"model\.safetensors: the header is not valid JSON"):
        check_model_folder(str(model_copy))


def test_sharded_checkpoint_with_a_missing_shard_is_named(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match=r"model\.safetensors\.index\.json names "
                                               r"model-00002-of-00002\.safetensors, which is not in"):
        check_model_folder(str(model_copy))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_messages_go_through_the_chat_template(tmp_path, tiny_model, chat_model):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
        {"prompt": [{"role": "system", "content": "terse"}, {"role": "user", "content": "2+2="}], "answer": "4"},
    ])
    rows = load_task_rows("jsonl", str(path), "prompt", "answer", "train")
    assert [r["question"] for r in rows] == ["1+1=", "2+2="]  # what a reward sees as the prompt: the last user turn
    tok = load_tokenizer(chat_model)
    # the messages need the template whatever data.chat_template says; data.system_prompt fills a missing system turn
    prompts = tokenize_rows(rows, tok, False, "be brief", 64, str(path))
    assert [tok.decode(p.ids) for p in prompts] == ["<system>be brief<user>1+1=<assistant>",
                                                    "<system>terse<user>2+2=<assistant>"]
    with pytest.raises(DataError, match=r"chat\.jsonl:1: .*chat messages.*tokenizer has no chat template"):
        tokenize_rows(rows, load_tokenizer(tiny_model), False, "", 64, str(path))


@pytest.mark.parametrize("value, got", [
    (["1+1=", "2+2="], r"a list holding str"),
    ([{"role": "user"}], r"a list whose message 1 has no string 'content'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x.png"}]}],
     r"a list whose message 1 has content part 1 of type 'image_url' \(tandem reads parts of type text and image\)"),
    ([], r"an empty list"),
    (12, r"int"),
    ({"role": "user", "content": "hi"}, r"dict"),
])
def test_a_prompt_that_is_neither_text_nor_messages_is_refused(tmp_path, value, got):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}, {"question": value, "answer": "3"}])
    with pytest.raises(DataError, match=rf"d\.jsonl:2: field 'question' must be a string or a list of chat messages "
                                        rf"\(\{{'role', 'content'\}} dicts\), got {got}"):
        load_task_rows("jsonl", str(path), "question", "answer", "train")


@pytest.mark.parametrize("value", [0, -3, "16", 2.5, True])
def test_a_rows_own_completion_limit_must_be_a_positive_integer(tmp_path, value):
    rows = [{"question": "1+1=", "answer": "2", "max_new_tokens": 16}, {"question": "2+2=", "answer": "4"},
            {"question": "3+3=", "answer": "6", "max_new_tokens": value}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=rf"d\.jsonl:3: field 'max_new_tokens' .* must be a positive integer, got "
                                        rf"{re.escape(repr(value))}"):
        load_task_rows("jsonl", str(path), "question", "answer", "train")
    good = load_task_rows("jsonl", str(write_jsonl(tmp_path / "ok.jsonl", rows[:2])), "question", "answer", "train")
    assert [r.get("max_new_tokens") for r in good] == [16, None]  # kept in the row, where sampling reads it


def test_non_utf8_bytes_name_the_file_line_and_offset(tmp_path):
    path = tmp_path / "latin1.jsonl"
    first = b'{"question": "1+1=", "answer": "2"}\n'
    path.write_bytes(first + '{"question": "caf\u00e9", "answer": "3"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=rf"latin1\.jsonl:2: not UTF-8: byte 0xe9 at byte offset {len(first) + 17} "
                                        r"\(column 18\)"):
        load_task_rows("jsonl", str(path), "question", "answer", "train")


def test_overlong_prompts_are_refused_or_skipped_and_reported(tmp_path, tiny_model, caplog):
    short, long = "1+1=", "1+1=" * 40
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": q, "answer": "2"} for q in (short, long, short, long)])
    rows = load_task_rows("jsonl", str(path), "question", "answer", "train")
    tok = load_tokenizer(tiny_model)
    with pytest.raises(DataError, match=r"d\.jsonl:2: prompt has \d+ tokens, over data\.max_prompt_tokens=16; "
                                        r".*data\.overlong_prompts=skip"):
        tokenize_rows(rows, tok, False, "", 16, str(path))
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        kept = tokenize_rows(rows, tok, False, "", 16, str(path), overlong="skip")
    assert [p.row["_line"] for p in kept] == [1, 3]
    assert "d.jsonl: skipped 2 of 4 prompts over data.max_prompt_tokens=16 (lines 2, 4)" in caplog.text
    with pytest.raises(DataError, match=r"d\.jsonl: all 2 prompts are over data\.max_prompt_tokens=16"):
        tokenize_rows(rows[1::2], tok, False, "", 16, str(path), overlong="skip")

    assert load_config(None, []).data.overlong_prompts == "error"
    assert load_config(None, ["data.overlong_prompts=skip"]).data.overlong_prompts == "skip"
    with pytest.raises(ConfigError, match=r"data\.overlong_prompts: .*'error' or 'skip'.*got 'drop'"):
        load_config(None, ["data.overlong_prompts=drop"])


def test_gsm8k_train_under_the_demo_tokenizer_skips_229(shared_dir, tiny_model, caplog):
    gsm = shared_dir / "data" / "gsm8k" / "train.jsonl"
    if not gsm.is_file():
        pytest.skip("shared/data/gsm8k not present")
    rows = load_task_rows("gsm8k", str(gsm), "question", "answer", "train")
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        kept = tokenize_rows(rows, load_tokenizer(tiny_model), False, "", 512, str(gsm), overlong="skip")
    assert len(rows) - len(kept) == 229
    assert "skipped 229 of 7473 prompts over data.max_prompt_tokens=512 (lines " in caplog.text
