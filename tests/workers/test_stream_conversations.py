"""Multi-turn conversations under the streaming schedule (hf engine): a turn is one request, the environment answers
it beside the decoding, the conversation's next turn continues from its exact ids, and a weight update between two
turns lands with each token tagged by the version that sampled it (its logprob that version's own)."""
from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch

from tandem.config import Config
from tandem.modeling import load_tokenizer
from tandem.rollout.hf import HFEngine
from tandem.rollout.multiturn import TurnLimits, converse
from tandem.rollout.tools import register_environment
from tandem.rollout.tools.base import StepResult
from tandem.run.source import sampling_for
from tandem.samples import ModelPrompt
from tandem.workers.stream import StreamGroup, StreamSampler

TURNS, TURN_TOKENS, TEMPERATURE = 3, 4, 0.8
OBSERVATION = "<r>7</r>"


class Echo:
    """Answers each turn with OBSERVATION (a tool call) until TURNS turns are done. `gate`, when set on the class,
    holds the answer of the conversation whose prompt is `gated` until it is released."""

    stop: tuple[str, ...] = ()
    gate: threading.Event | None = None
    gated: str = ""

    def __init__(self):
        self.seen, self.prompt = 0, ""

    def reset(self, prompt: str) -> str:
        self.prompt = prompt
        return ""

    def step(self, turn_text: str) -> StepResult:
        if Echo.gate is not None and self.prompt == Echo.gated:
            assert Echo.gate.wait(30), "the gate was never opened"
        self.seen += 1
        done = self.seen >= TURNS
        return StepResult("" if done else OBSERVATION, 1.0 if done else None, done, None if done else "echo")


register_environment("stream-test-echo")(Echo)


def _cfg(model, group_size: int, slots: int, **rollout) -> Config:
    return Config.model_validate({
        "model": {"path": str(model)}, "batch": {"prompts_per_step": 1, "group_size": group_size},
        "rollout": {"max_new_tokens": TURN_TOKENS, "ignore_eos": True, "temperature": TEMPERATURE,
                    "max_in_flight": slots, **rollout},
        "env": {"name": "stream-test-echo", "max_turns": TURNS, "max_tokens": 64},
        "placement": {"schedule": "stream"}})


def _forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _drain(sampler: StreamSampler, until=lambda s: False) -> list:
    handed = []
    while sampler.in_flight and not until(sampler):
        sampler.step()
        handed += sampler.take().groups
    return handed


@pytest.fixture
def engine(tiny_model):
    return HFEngine(str(tiny_model), seed=0)


@pytest.fixture
def prompt(tiny_model):
    return load_tokenizer(tiny_model).encode("12+34=")


def test_streamed_conversations_are_the_conversations_converse_samples(engine, prompt, tiny_model):
    """Same engine, same seeds, no update: each conversation (its turns' tokens, the environment's tokens masked
    with logprob 0, its turns and calls) is the one `converse` samples; its sampled tokens' logprobs are a fresh
    forward's of the whole conversation, so each turn continued from the exact ids before it."""
    cfg, G = _cfg(tiny_model, group_size=3, slots=2), 3  # two slots, three conversations: turns wait for slots too
    sampler = StreamSampler(cfg, engine)
    sampler.add([StreamGroup(5, ModelPrompt(prompt), G, seed=11, max_new_tokens=TURN_TOKENS)], sampling_for(cfg, None))
    ((serial, streamed),) = _drain(sampler)
    assert serial == 5 and not sampler.conversations and not sampler.answering
    expected = converse(engine, engine.tokenizer, [prompt], dataclasses.replace(sampling_for(cfg, None), seeds=(11,)),
                        Echo, TurnLimits(TURNS, cfg.max_completion_tokens))
    observed = engine.tokenizer.encode(OBSERVATION, add_special_tokens=False)
    turn_mask = [1] * TURN_TOKENS
    for got, want in zip(streamed, expected, strict=True):
        assert got.completion_ids == want.completion_ids and got.loss_mask == want.loss_mask
        assert got.loss_mask == (turn_mask + [0] * len(observed)) * (TURNS - 1) + turn_mask
        assert got.meta["turns"] == TURNS and got.meta["tool_calls"] == TURNS - 1 and got.meta["env_reward"] == 1.0
        assert got.versions == [0] * len(got.completion_ids)
        sampled = torch.tensor([m == 1 for m in got.loss_mask])
        lp = torch.tensor(got.logprobs)
        assert torch.all(lp[~sampled] == 0)
        fresh = _forward_logprobs(engine.model, got.prompt_ids, got.completion_ids)
        assert torch.allclose(lp[sampled], fresh[sampled], atol=1e-5)
        assert torch.allclose(lp, torch.tensor(want.logprobs), atol=1e-5)


def test_a_weight_update_between_turns_tags_each_token_with_its_version(engine, prompt, tiny_model):
    """New weights land after every conversation's first turn is answered: the tokens sampled before are version 0
    and match the old weights' forward; those after are version 1 and match the new weights' forward over the whole
    conversation (its earlier turns prefilled again)."""
    cfg = _cfg(tiny_model, group_size=2, slots=2)
    sampler = StreamSampler(cfg, engine)
    sampler.add([StreamGroup(0, ModelPrompt(prompt), 2, seed=3, max_new_tokens=TURN_TOKENS)], sampling_for(cfg, None))
    _drain(sampler, until=lambda s: all(c.turns >= 1 for c, _ in s.conversations.values()) and not s.answering)
    old = copy.deepcopy(engine.model)
    g = torch.Generator().manual_seed(1)
    engine.load_weights([(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g))
                         for n, p in engine.model.named_parameters()])
    sampler.weights_changed(1)
    ((_, comps),) = _drain(sampler)
    for c in comps:
        v, lp = torch.tensor(c.versions), torch.tensor(c.logprobs)
        sampled = torch.tensor([m == 1 for m in c.loss_mask])
        # the environment's tokens carry the version held when they were appended (0 here: answered before the load)
        assert c.versions == sorted(c.versions) and c.versions[:TURN_TOKENS] == [0] * TURN_TOKENS
        assert c.versions[-1] == 1 and c.meta["turns"] == TURNS
        under_old = _forward_logprobs(old, c.prompt_ids, c.completion_ids)
        under_new = _forward_logprobs(engine.model, c.prompt_ids, c.completion_ids)
        assert torch.allclose(lp[sampled & (v == 0)], under_old[sampled & (v == 0)], atol=1e-5)
        assert torch.allclose(lp[sampled & (v == 1)], under_new[sampled & (v == 1)], atol=1e-5)
        assert not torch.allclose(lp[sampled & (v == 1)], under_old[sampled & (v == 1)], atol=1e-3)


def test_a_slow_tool_does_not_hold_up_the_other_conversations(engine, tiny_model):
    """One conversation's environment blocks on its first answer: the other group's conversations decode on and
    finish meanwhile (a tool answers on a thread of its own), and the blocked one finishes once released."""
    tok = load_tokenizer(tiny_model)
    slow, fast = tok.encode("7+5="), tok.encode("99+99=")
    cfg = _cfg(tiny_model, group_size=2, slots=2)  # groups of one here: the slots, not the algorithm, under test
    sampler = StreamSampler(cfg, engine)
    Echo.gate, Echo.gated = threading.Event(), tok.decode(slow)
    try:
        sampler.add([StreamGroup(0, ModelPrompt(slow), 1, seed=0, max_new_tokens=TURN_TOKENS),
                     StreamGroup(1, ModelPrompt(fast), 1, seed=1, max_new_tokens=TURN_TOKENS)], sampling_for(cfg, None))
        handed = _drain(sampler, until=lambda s: 0 not in s.groups or 1 not in s.groups)
        assert [serial for serial, _ in handed] == [1] and (0, 0) in sampler.answering  # still waiting for its tool
        Echo.gate.set()
        handed = _drain(sampler)
        assert [serial for serial, _ in handed] == [0] and handed[0][1][0].meta["turns"] == TURNS
    finally:
        Echo.gate.set()
        Echo.gate = None
        sampler.close()


def test_under_drop_a_conversation_too_stale_begins_again_whole(engine, prompt, tiny_model):
    """rollout.partial: drop: a conversation whose first sampled token the bound leaves behind begins again from its
    prompt on a fresh environment, in its first turn as in a later one."""
    cfg = _cfg(tiny_model, group_size=2, slots=4, partial="drop")
    sampler = StreamSampler(cfg, engine)
    sampler.add([StreamGroup(0, ModelPrompt(prompt), 2, seed=0, max_new_tokens=TURN_TOKENS)], sampling_for(cfg, None))
    sampler.step()
    sampler.step()  # both conversations two tokens into their first turn, at version 0
    assert all(conv.turns == 0 for conv, _ in sampler.conversations.values())
    sampler.weights_changed(1)  # within the bound (max_staleness 1): kept
    assert sampler.take().restarted == 0
    sampler.weights_changed(2)  # version 0 is now beyond it
    assert sampler.take().restarted == 2
    assert all(len(r.tokens) == 0 and r.restarts == 1 for r in sampler.session.requests())
    ((_, comps),) = _drain(sampler)
    assert all(set(c.versions) == {2} and c.meta["turns"] == TURNS for c in comps)
