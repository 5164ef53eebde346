"""The streaming schedule end to end on one real engine (no Ray): the controller's rollout source over a stream sampler
made slow on purpose, whose weights land late. Every trained token is within the staleness bound, groups train whole,
and a checkpoint's prompt stream resamples every group in flight."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from tandem.config import Config
from tandem.data.sources import Prompt, PromptStream
from tandem.modeling import load_tokenizer
from tandem.rewards.base import RewardResult
from tandem.rollout.hf import HFEngine
from tandem.run.source import RolloutSource
from tandem.samples import ModelPrompt
from tandem.workers.stream import StreamSampler

P, G, BOUND = 2, 2, 1
SHORT, LONG = 2, 14


class SlowSampler:
    """A placement of one stream sampler, slow on purpose: one decode step per take, and each new policy version
    lands `lag` takes after the trainer published it (as a weight sync still on its way)."""

    def __init__(self, cfg: Config, engine: HFEngine, lag: int):
        self.sampler = StreamSampler(cfg, engine)
        self.samplers = SimpleNamespace(size=1)
        self.lag, self.arriving = lag, deque()
        self.groups_added: list[int] = []  # each group's size as it was handed to the sampler

    def publish(self, version: int) -> None:
        self.arriving.append([version, self.lag])

    def stream_add(self, groups, sampling) -> None:
        (mine,) = groups
        self.groups_added += [g.n for g in mine]
        self.sampler.add(mine, sampling)

    def stream_take(self, timeout: float):
        for item in self.arriving:
            item[1] -= 1
        while self.arriving and self.arriving[0][1] <= 0:
            self.sampler.weights_changed(self.arriving.popleft()[0])
        self.sampler.step()
        return [self.sampler.take()]


def _prompts(tiny_model) -> list[Prompt]:
    tok = load_tokenizer(tiny_model)
    # every third prompt's completions are long: they span several updates while the short ones train
    return [Prompt(tok.encode(f"{i}+{i + 1}="), {"question": str(i), "max_new_tokens": LONG if i % 3 == 0 else SHORT})
            for i in range(24)]


def _source(tiny_model, partial: str, lag: int):
    cfg = Config.model_validate({
        "batch": {"prompts_per_step": P, "group_size": G},
        "rollout": {"max_new_tokens": LONG, "ignore_eos": True, "partial": partial, "max_in_flight": 5},
        "data": {"max_prompt_tokens": 16},
        "placement": {"schedule": "stream", "max_staleness": BOUND}})
    scores = lambda texts, questions, rows: RewardResult(  # noqa: E731  a spread in every group: none filtered
        total=[float(i % 2) for i in range(len(texts))], per_fn={"exact": [float(i % 2) for i in range(len(texts))]})
    scorer = SimpleNamespace(score=scores, error_limit=SimpleNamespace(observe=lambda *a: {}))
    stream = PromptStream(_prompts(tiny_model), seed=0)
    placement = SlowSampler(cfg, HFEngine(str(tiny_model), seed=0), lag)
    return RolloutSource(cfg, stream, placement, scorer, "exact", 0, lambda: None), placement, stream


def _train(source: RolloutSource, placement: SlowSampler, steps: int) -> list[tuple]:
    out = []
    for step in range(1, steps + 1):
        batch, stats = source.next(step)
        out.append((step, batch, stats))
        placement.publish(step)  # the trainer's new version, on its way to the sampler
    return out


@pytest.mark.parametrize("partial", ["drop", "resume"])
def test_every_trained_token_is_within_the_staleness_bound_of_a_slow_late_sampler(tiny_model, partial):
    source, placement, _ = _source(tiny_model, partial, lag=3)
    masked = restarted = long_trained = 0
    for step, batch, stats in _train(source, placement, 10):
        comps = batch.samples.completions
        assert batch.samples.num_groups == P and len(comps) == P * G  # whole groups, P of them
        assert batch.samples.group.tolist() == [g for g in range(P) for _ in range(G)]
        for c in comps:
            assert len(c.versions) == len(c.completion_ids)
            trained = [v for v, m in zip(c.versions, c.loss_mask or [1] * len(c.versions)) if m]
            assert all((step - 1) - v <= BOUND for v in trained), (step, c.versions, c.loss_mask)
            if partial == "drop":  # no token beyond the bound, trained or not
                assert all((step - 1) - v <= BOUND for v in c.versions)
            long_trained += len(c.completion_ids) == LONG
        if partial == "drop":
            assert stats["async/staleness"] <= BOUND
        masked += stats.get("stream/stale_masked_frac", 0) > 0
        restarted += stats.get("stream/restarted", 0)
    assert set(placement.groups_added) == {G}
    # the schedule was adversarial enough to need the bound's machinery
    if partial == "drop":
        assert restarted > 0
    else:
        assert masked > 0 and long_trained > 0  # resume keeps the long requests' work and trains their tail


def test_a_group_waits_whole_in_the_sampler_until_its_last_request_stops(tiny_model):
    """Three slots for a group of four: the fourth request starts only when one of the first three stops, so the
    group's requests finish over several takes; no take hands out part of it."""
    cfg = Config.model_validate({"batch": {"prompts_per_step": 1, "group_size": 4},
                                 "rollout": {"max_new_tokens": 3, "ignore_eos": True, "max_in_flight": 3},
                                 "placement": {"schedule": "stream"}})
    from tandem.run.source import sampling_for
    from tandem.workers.stream import StreamGroup

    sampler = StreamSampler(cfg, HFEngine(str(tiny_model), seed=0))
    sampler.add([StreamGroup(7, ModelPrompt([3, 4, 5]), 4, seed=0, max_new_tokens=3)], sampling_for(cfg, None))
    partial_seen, handed = False, []
    while sampler.in_flight:
        sampler.step()
        done = sampler.groups.get(7, (None, {}))[1]
        partial_seen |= 0 < len(done) < 4
        handed += sampler.take().groups
        if len(done) < 4 and not handed:
            assert sampler.outbox == []
    assert partial_seen  # the test reached a state where a group was half done
    assert [(s, len(comps)) for s, comps in handed] == [(7, 4)]
    assert [c.versions for c in handed[0][1]] == [[0, 0, 0]] * 4


def test_a_resumed_stream_resamples_every_group_in_flight_first(tiny_model):
    source, placement, stream = _source(tiny_model, "resume", lag=1)
    _train(source, placement, 3)
    in_flight = [p for p, _ in source.started.values()] + [p for _, p, _ in source.ready]
    assert in_flight  # groups were started and not trained when the checkpoint was taken
    state = source.resume_state()
    resumed = PromptStream(_prompts(tiny_model), seed=0)
    resumed.load_state_dict(state)
    again = resumed.take(len(in_flight))
    assert [p.row["question"] for p in again] == [p.row["question"] for p in in_flight]
    # then the stream goes on where the run had reached: no prompt skipped, none sampled twice
    assert [p.row["question"] for p in resumed.take(4)] == [p.row["question"] for p in stream.take(4)]


def test_drop_stops_the_run_naming_the_fix_when_a_request_can_never_finish(tiny_model, caplog):
    """A request that needs more decoding than max_staleness + 1 updates allow: under drop it begins again at every
    other update and would never finish; its third restart is warned about, its eighth stops the run."""
    from tandem.run.source import sampling_for
    from tandem.workers.stream import DROP_RESTARTS, StreamGroup

    cfg = Config.model_validate({"batch": {"prompts_per_step": 1, "group_size": 2},
                                 "rollout": {"max_new_tokens": 64, "ignore_eos": True, "partial": "drop"},
                                 "placement": {"schedule": "stream", "max_staleness": 1}})
    sampler = StreamSampler(cfg, HFEngine(str(tiny_model), seed=0))
    sampler.add([StreamGroup(0, ModelPrompt([3, 4, 5]), 2, seed=0, max_new_tokens=64)], sampling_for(cfg, None))
    with pytest.raises(RuntimeError, match=r"begun a request again 8 times .* Set rollout\.partial: resume"):
        for version in range(1, 4 * DROP_RESTARTS):
            sampler.step()
            sampler.weights_changed(version)
    assert version == 2 * DROP_RESTARTS  # one restart every other update: the first token is then too old
    assert "begun a request again 3 times" in caplog.text


def test_a_sampler_with_nothing_in_flight_counts_the_time_as_idle(tiny_model):
    """The sampler's idle share (`time/sampler_idle`, bench_stream.py's column) is the time since its last step
    while nothing was in flight: a sampler waiting 0.2 s for groups reports at least that, and none of it busy."""
    import time

    cfg = Config.model_validate({"batch": {"prompts_per_step": 1, "group_size": 2},
                                 "rollout": {"max_new_tokens": 3, "ignore_eos": True},
                                 "placement": {"schedule": "stream"}})
    sampler = StreamSampler(cfg, HFEngine(str(tiny_model), seed=0))
    sampler.take()
    time.sleep(0.2)
    assert sampler.step() is False
    report = sampler.take()
    assert report.idle_seconds >= 0.2 and report.busy_seconds == 0


def test_a_streamed_prompt_with_images_is_refused_not_sampled_without_them():
    """A stream's requests are ids alone: a group whose prompt brings images is refused, naming them and the
    schedule, before any request starts (red if they were dropped silently)."""
    from tandem.run.source import sampling_for
    from tandem.samples import Images
    from tandem.workers.stream import StreamGroup

    cfg = Config.model_validate({"batch": {"prompts_per_step": 1, "group_size": 2},
                                 "placement": {"schedule": "stream"}})
    sampler = StreamSampler(cfg, engine=None)  # refused before the engine is asked anything
    pictured = ModelPrompt([3, 4, 5], Images("k", ("red.png",), {}))
    with pytest.raises(ValueError, match=r"group 3's prompt holds images \(red\.png\).*placement\.schedule: stream"):
        sampler.add([StreamGroup(3, pictured, 2, seed=0, max_new_tokens=3)], sampling_for(cfg, None))
    assert not sampler.groups
