"""pass@k's unbiased estimator against hand counts, figures per reward and per task, and `tandem eval` on a model
folder: the figures, the results file and the samples."""
from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path

import pytest

from tandem.run.evaluation import pass_at_k

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # toy_rewards, a plugin module


@pytest.mark.parametrize("n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (8, 3, 8), (6, 6, 2)])
def test_pass_at_k_counts_subsets(n, c, k):
    """Exactly the share of k-subsets of the n samples that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    expected = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_nonsense():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_eval_cli_on_a_model_folder(tiny_model, tmp_path, capsys):
    """The figures printed, the results file (--output) holding the same with what was evaluated, and every
    completion with its scores (--samples); flags among the overrides."""
    from tandem.cli import main

    results, samples = tmp_path / "results.json", tmp_path / "samples.jsonl"
    code = main(["eval", "--model", str(tiny_model), "data.eval_size=6", "--k", "4", "run.progress=false",
                 "--output", str(results), f"run.output_dir={tmp_path / 'out'}", "--samples", str(samples),
                 "rollout.max_new_tokens=4"])
    assert code == 0
    text = capsys.readouterr().out
    out = json.loads(text[text.index("{"):])
    assert set(out) >= {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4"}
    assert out["eval/pass@1"] == pytest.approx(out["eval/mean@4"])
    assert out["eval/pass@1"] <= out["eval/pass@2"] <= out["eval/pass@4"]
    assert not (tmp_path / "out").exists()  # evaluation writes no run folder
    doc = json.loads(results.read_text())
    assert {f"eval/{k}": v for k, v in doc["results"].items()} == out
    assert (doc["model"], doc["task"], doc["prompts"], doc["k"]) == (str(tiny_model), "arithmetic", 6, 4)
    assert doc["per_task"]["arithmetic"] == {k: v for k, v in doc["results"].items() if "errors" not in k}
    assert doc["per_reward"]["arithmetic_exact"]["accuracy"] == doc["results"]["accuracy"]
    assert doc["config"]["model"]["path"] == str(tiny_model)
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [s["kind"] for s in lines].count("greedy") == 6 and len(lines) == 6 * (1 + 4)
    greedy = [s for s in lines if s["kind"] == "greedy"]
    assert sum(s["scores"]["arithmetic_exact"] >= 1 for s in greedy) / 6 == out["eval/accuracy"]


def test_figures_per_reward_and_per_task():
    """Rows of two tasks, two rewards: each task's figures over its own prompts, each reward's over its own
    verdicts (hand counts: the completion is correct for prompts 0 and 2 by the first reward, for all by the
    second)."""
    from tandem.data.sources import Prompt
    from tandem.rewards import RewardScorer
    from tandem.rollout import Completion, Samples
    from tandem.rollout.base import Sampling
    from tandem.run.evaluation import evaluate

    rows = [{"question": "a", "target": "1", "task": "add"}, {"question": "b", "target": "2", "task": "add"},
            {"question": "c", "target": "1"}]
    prompts = [Prompt([5 + i], row) for i, row in enumerate(rows)]

    def generate(prompts, sampling):
        return Samples.of_call([Completion(list(p.ids), [7], [-1.0], "1", "stop", i) for i, p in enumerate(prompts)
                                for _ in range(sampling.n)], len(prompts))

    rewards = [("toy_rewards:matches_target", 1.0, {}), ("toy_rewards:always_one", 0.5, {})]
    with RewardScorer(rewards, workers=0) as scorer:
        ev = evaluate(generate, prompts, scorer, "toy_rewards:matches_target", Sampling(max_new_tokens=2, seed=0),
                      k=2, task="mul")
    assert ev.figures["accuracy"] == pytest.approx(2 / 3) and ev.figures["pass@2"] == pytest.approx(2 / 3)
    assert ev.per_task["add"]["accuracy"] == 0.5 and ev.per_task["mul"]["accuracy"] == 1.0
    assert ev.per_task["add"]["mean@2"] == 0.5 and ev.per_task["mul"]["pass@2"] == 1.0
    assert ev.per_reward["toy_rewards:always_one"] == {"accuracy": 1.0, "reward": 1.0, "pass@1": 1.0,
                                                       "pass@2": 1.0, "mean@2": 1.0}
    assert ev.per_reward["toy_rewards:matches_target"]["accuracy"] == pytest.approx(2 / 3)
    assert len(ev.samples) == 3 * 3 and ev.prompts == 3


def test_eval_cli_refuses_a_checkpoint_whose_checksums_fail(tiny_model, tmp_path, capsys):
    """A checkpoint (tiny_model's files saved as one, with their checksums) evaluates; with one bit flipped in its
    tensor data, where headers and sizes show nothing, eval exits 2 naming the file, in one line."""
    import shutil
    import struct

    import torch

    from tandem.cli import main
    from tandem.run import checkpoint

    def write_model(folder: str) -> None:
        shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
        torch.save({}, Path(folder) / "optimizer.pt")

    ck = checkpoint.save(tmp_path / "checkpoints", 1, write_model, {"step": 1, "data": {}}, keep=1)
    args = ["eval", "--model", str(ck), "data.eval_size=2", "rollout.max_new_tokens=2", "run.progress=false"]
    assert main(args) == 0
    weights = ck / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_len + (len(raw) - 8 - header_len) // 2] ^= 0x04  # past the header: the file keeps its size
    weights.write_bytes(raw)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    line = [text for text in err.splitlines() if text.startswith("tandem: error:")]
    assert len(line) == 1 and "Traceback" not in err, err
    assert str(ck) in line[0] and "model.safetensors: checksum mismatch" in line[0], err
