"""Samples: a step's completions with their group ids, kept right by concat and select."""
from __future__ import annotations

import pytest
import torch

from tandem.rollout.base import Completion, Samples
from tandem.samples import Images, ModelPrompt, model_prompts


def _call(n_prompts: int, n: int, tag: str) -> list[Completion]:
    """What one generate call returns: n completions per prompt, grouped in prompt order."""
    return [Completion([i], [i, k], [0.0, 0.0], f"{tag}{i}.{k}", "stop", i) for i in range(n_prompts) for k in range(n)]


def test_a_second_calls_groups_follow_the_firsts():
    a, b = Samples.of_call(_call(2, 2, "a")), Samples.of_call(_call(3, 1, "b"))
    both = a.concat(b)
    assert both.group.tolist() == [0, 0, 1, 1, 2, 3, 4] and both.num_groups == 5
    assert [c.text for c in both.completions] == ["a0.0", "a0.1", "a1.0", "a1.1", "b0.0", "b1.0", "b2.0"]
    # the engine's prompt_index stays what it was: the index into its own call
    assert [c.prompt_index for c in both.completions] == [0, 0, 1, 1, 0, 1, 2]


def test_a_call_whose_last_prompts_lost_their_rows_keeps_its_prompt_count():
    a = Samples.of_call(_call(2, 2, "a")[:2], num_prompts=2)  # prompt 1's rows are gone
    assert a.concat(Samples.of_call(_call(1, 1, "b"))).group.tolist() == [0, 0, 2]


def test_select_renumbers_the_kept_groups_in_order_of_first_appearance():
    s = Samples.of_call(_call(4, 2, "x"))
    kept = s.select([6, 7, 2, 3])
    assert kept.group.tolist() == [0, 0, 1, 1] and kept.num_groups == 2
    assert [c.text for c in kept.completions] == ["x3.0", "x3.1", "x1.0", "x1.1"]
    assert s.select([]).num_groups == 0 and len(s.select([])) == 0


def test_lengths_and_truncation_per_row():
    comps = [Completion([1, 2], [3], [0.0], "", "stop", 0), Completion([1, 2], [3, 4, 5], [0.0] * 3, "", "length", 0)]
    s = Samples.of_call(comps)
    assert s.completion_lengths.tolist() == [1, 3] and s.sequence_lengths == [3, 5]
    assert s.truncated.tolist() == [False, True]


def test_a_group_id_per_completion_is_required():
    with pytest.raises(ValueError, match="2 group ids for 1 completions"):
        Samples(_call(1, 1, "z"), torch.tensor([0, 0]), 1)


def test_prompts_reach_an_engine_as_model_prompts_with_their_images():
    """A text prompt's ids alone become a `ModelPrompt` without images; a `ModelPrompt` passes as it is (its images the
    same object, which every completion sampled from it then holds); ids are kept immutable."""
    pictured = ModelPrompt([1, 2], Images("k", ("red.png",), {}))
    text, same = model_prompts([[3, 4], pictured])
    assert text == ModelPrompt((3, 4)) and text.images is None and same is pictured
    assert pictured.ids == (1, 2) and hash(pictured) == hash(ModelPrompt((1, 2), pictured.images))
