"""The hf engine's continuous batching (streaming schedule): requests join and leave between decode steps, and a
request carried across a weight update records the version of each token, whose logprobs match a fresh forward of
the weights that sampled it."""
from __future__ import annotations

import copy

import pytest
import torch

import zoo_models
from tandem.modeling import load_tokenizer
from tandem.rollout import Sampling
from tandem.rollout.hf import HFEngine
from tandem.rollout.hf.stream import HFStream, SlotDecoder
from tandem.rollout.requests import Request

TEMPERATURE = 0.8


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's token logprobs by one fresh forward of prompt + completion: what the trainer computes."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.fixture
def engine(tiny_model):
    return HFEngine(str(tiny_model), seed=0)


@pytest.fixture
def prompts(tiny_model):
    tok = load_tokenizer(tiny_model)
    return [tok.encode(q) for q in ("12+34=", "7+5=", "99+99=", "3+4=")]


def _stream(engine, slots=3):
    return HFStream(engine, Sampling(n=1, temperature=TEMPERATURE, max_new_tokens=40, ignore_eos=True), slots)


def _run(stream: HFStream, version: int, steps: int | None = None) -> list:
    done, taken = [], 0
    while stream.in_flight and (steps is None or taken < steps):
        done += stream.step(version)
        taken += 1
    return done


def test_requests_join_as_slots_free_and_each_stops_at_its_own_limit(engine, prompts):
    stream = _stream(engine, slots=2)
    limits = [3, 9, 5, 2]
    for i, (p, n) in enumerate(zip(prompts, limits)):
        stream.add(Request(i, p, n, seed=10 + i))
    assert stream.in_flight == 4
    first = _run(stream, 0, steps=3)  # request 0 stops at 3 tokens; 2 and 3 wait for a slot until then
    assert [f.request.key for f in first] == [0] and list(stream.running) == [1] and len(stream.waiting) == 2
    first += _run(stream, 0, steps=1)  # the next step admits request 2 into the freed slot, beside request 1
    assert list(stream.running) == [1, 2] and [r.key for r in stream.waiting] == [3]
    done = first + _run(stream, 0)
    assert sorted(f.request.key for f in done) == [0, 1, 2, 3]
    model = engine.model
    for f in done:
        r = f.request
        assert len(r.tokens) == limits[r.key] and f.finish_reason == "length" and r.versions == [0] * len(r.tokens)
        # joining mid-batch, leaving, slots compacted: none of it changes the numbers
        assert torch.allclose(torch.tensor(r.logprobs), forward_logprobs(model, r.prompt_ids, r.tokens), atol=1e-5)


def test_the_cache_keeps_no_column_that_no_row_uses(engine, prompts):
    """A row that leaves takes its positions with it: the cache narrows to the longest row left, so a stream that
    runs on never grows wider than its longest request (a new row is padded to the cache's width)."""
    stream = _stream(engine, slots=2)
    stream.add(Request(0, prompts[0] + [5] * 20, 2, seed=0))
    stream.add(Request(1, prompts[1], 9, seed=1))
    _run(stream, 0, steps=4)  # request 0 stops at its 2nd token; request 1 decodes on
    r = stream.running[1]
    assert list(stream.running) == [1] and stream.decoder.mask.shape == (1, len(r.prompt_ids) + len(r.tokens))
    assert bool(stream.decoder.mask.all())


def test_a_request_carried_across_a_weight_update_is_exact_under_each_version(engine, prompts):
    _carried_across_an_update(engine, prompts)


@pytest.mark.parametrize("arch", [a for a in zoo_models.ARCHITECTURES
                                  if a not in zoo_models.WINDOWED + zoo_models.HYBRID])
def test_every_zoo_architecture_streams_exactly_across_a_weight_update(arch, tmp_path):
    """The stream decodes with the model's own forward, so every architecture of the zoo without sliding-window or
    linear-attention layers streams (tandem.architectures refuses the rest before any model loads): Llama 3's rope
    scaling, Qwen3's q/k norms, Gemma's scaled embeddings, Phi-3's fused projections, and the MoEs' routers included."""
    folder = zoo_models.build(tmp_path / arch, arch)
    tok = load_tokenizer(folder)
    _carried_across_an_update(HFEngine(str(folder), seed=0), [tok.encode(q) for q in ("12+34=", "7+5=", "99+99=")])


def _carried_across_an_update(engine: HFEngine, prompts: list[list[int]]) -> None:
    """Requests stopped 4 tokens in by a weight load and a reload: each token carries the version that sampled it,
    and its logprob is a fresh forward's under those weights."""
    stream = _stream(engine, slots=4)
    for i, p in enumerate(prompts):
        stream.add(Request(i, p, 6 + 3 * i, seed=i))
    _run(stream, 0, steps=4)
    old = copy.deepcopy(engine.model)
    g = torch.Generator().manual_seed(1)
    new = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in engine.model.named_parameters()}
    engine.load_weights(new.items())  # in place, as a sync lands between two decode steps
    stream.reload()
    done = _run(stream, 1)
    assert len(done) == len(prompts)
    for f in done:
        r = f.request
        assert r.versions == [0] * 4 + [1] * (len(r.tokens) - 4)
        sampled = torch.tensor(r.logprobs)
        v = torch.tensor(r.versions)
        # each token's logprob is that of the weights that sampled it, over the whole prefix: the trainer
        # holding version 1 computes for the tokens after the update what the sampler recorded
        under_new = forward_logprobs(engine.model, r.prompt_ids, r.tokens)
        under_old = forward_logprobs(old, r.prompt_ids, r.tokens)
        assert torch.allclose(sampled[v == 1], under_new[v == 1], atol=1e-5), (sampled, under_new)
        assert torch.allclose(sampled[v == 0], under_old[v == 0], atol=1e-5)
        assert not torch.allclose(sampled[v == 1], under_old[v == 1], atol=1e-3)  # the weights did change


def test_without_a_reload_the_stale_caches_would_show(engine, prompts):
    """The check above can fail: decoding on over the old weights' keys and values (no prefill again) gives
    logprobs that differ from the new weights' fresh forward."""
    stream = _stream(engine, slots=1)
    stream.add(Request(0, prompts[0], 10, seed=0))
    _run(stream, 0, steps=4)
    g = torch.Generator().manual_seed(1)
    engine.load_weights([(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g))
                         for n, p in engine.model.named_parameters()])
    # no reload: the next tokens come from the new weights, but the cached prefix holds the old weights' keys
    r = _run(stream, 1)[0].request
    fresh = forward_logprobs(engine.model, r.prompt_ids, r.tokens)[4:]
    assert not torch.allclose(torch.tensor(r.logprobs[4:]), fresh, atol=1e-5)


def test_a_long_tailed_prefill_batches_rows_of_like_length_and_matches_one_by_one(engine, prompts, monkeypatch):
    calls = []
    real = SlotDecoder._prefill

    def recording(self, prefixes):
        calls.append(sorted(len(p) for p in prefixes))
        return real(self, prefixes)

    monkeypatch.setattr(SlotDecoder, "_prefill", recording)
    prefixes = [prompts[0] + [5] * 30, prompts[1], prompts[2], prompts[3] + [7] * 2]
    with torch.inference_mode():
        together = SlotDecoder(engine.model, 4).fill(list(range(4)), prefixes)
        alone = [SlotDecoder(engine.model, 1).fill([0], [p])[0] for p in prefixes]
    assert len(calls[0]) == 3 and calls[1] == [len(prefixes[0])]  # the long one alone, not padding the rest
    assert torch.allclose(together, torch.stack(alone), atol=1e-5)


@pytest.mark.parametrize("change", [("sliding_window", 16), ("model_type", "gpt_neox")])
def test_the_stream_refuses_a_model_it_cannot_decode(engine, monkeypatch, change):
    """A sliding-window layer (its cache keeps only the window, which the decoder's padded rows cannot follow), or an
    architecture outside the zoo; the config refuses both before any model loads (tests/core/test_model_zoo.py)."""
    monkeypatch.setattr(engine.model.config, *change)
    with pytest.raises(ValueError, match="the hf engine streams the model zoo's architectures with full attention in "
                                         "every layer"):
        _stream(engine)
