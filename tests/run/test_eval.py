"""pass@k's unbiased estimator against hand counts, and `tandem eval` on a checkpoint."""
from __future__ import annotations

import json
from itertools import combinations

import pytest

from tandem.run.evaluation import pass_at_k


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
    from tandem.cli import main

    code = main(["eval", "--model", str(tiny_model), "--k", "4", "data.eval_size=6", "run.progress=false",
                 f"run.output_dir={tmp_path / 'out'}", "rollout.max_new_tokens=4"])
    assert code == 0
    text = capsys.readouterr().out
    out = json.loads(text[text.index("{"):])
    assert set(out) >= {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4"}
    assert out["eval/pass@1"] == pytest.approx(out["eval/mean@4"])
    assert out["eval/pass@1"] <= out["eval/pass@2"] <= out["eval/pass@4"]
    assert not (tmp_path / "out").exists()  # evaluation writes no run folder
