"""Multi-turn rollouts: trained ids are the sampled ids, the trainer's logprobs the sampler's, an environment's tokens
carry no gradient, turns of all conversations are batched, and every limit ends a conversation."""
from __future__ import annotations

import pytest
import torch

from tandem.config import AlgoConfig, OldLogprobs, OptimConfig
from tandem.modeling import load_tokenizer
from tandem.rollout.base import Completion, Sampling, Samples
from tandem.rollout.hf import HFEngine
from tandem.rollout.multiturn import TurnLimits, conversation_stats, converse
from tandem.rollout.tools.base import StepResult
from tandem.samples import Images, ModelPrompt
from tandem.train.batch import make_micro_batches
from tandem.train.logprobs import token_logprobs
from tandem.train.policy import Policy

SAMPLING = Sampling(n=2, temperature=1.0, max_new_tokens=5, seed=7)
LIMITS = TurnLimits(3, 64)


class Echo:
    """Answers every turn with a fixed observation until `turns` turns are done (a tool called each time)."""

    stop: tuple[str, ...] = ()

    def __init__(self, turns: int = 3, observation: str = "12+34=", error: str | None = None,
                 reward: float | None = None):
        self.turns, self.observation, self.error, self.reward, self.seen = turns, observation, error, reward, 0

    def reset(self, prompt: str) -> str:
        return ""

    def step(self, turn_text: str) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult("" if done else self.observation, self.reward if done else None, done,
                          None if done else "echo", None if done else self.error)


class CountingEngine:
    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sampling):
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, sampling)


@pytest.fixture(scope="module")
def parts(tiny_model):
    tok = load_tokenizer(tiny_model)
    return tok, HFEngine(str(tiny_model), seed=0)


def conversations(parts, prompts, make_env=Echo, limits=LIMITS):
    tok, engine = parts
    counting = CountingEngine(engine)
    return converse(counting, tok, prompts, Sampling(n=2, temperature=1.0, max_new_tokens=5, seed=7, ignore_eos=True),
                    make_env, limits), counting.calls


def trainer_logprobs(tiny_model, comps: list[Completion]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(trainer's, sampler's) logprobs of the trained tokens of each row, as training lays the rows out."""
    policy = Policy(str(tiny_model), "float32", False, AlgoConfig(), OptimConfig(), 1, 1.0, 64,
                    old_logprobs=OldLogprobs.CURRENT)
    samples = Samples.of_call(comps)
    ours, theirs = [], []
    for mb in make_micro_batches(samples, 4096, 0):
        with torch.no_grad():
            lp, _ = token_logprobs(policy.model, mb, 1.0)
        for j, _row in enumerate(mb.rows):
            keep = mb.mask[j] > 0
            ours.append(lp[j][keep])
            theirs.append(mb.sampler_logprobs[j][keep])
    return ours, theirs


def test_trained_tokens_are_the_sampled_ones_and_logprobs_agree(parts, tiny_model):
    tok, _ = parts
    prompts = [tok.encode("12+34="), tok.encode("56+7=")]
    comps, calls = conversations(parts, prompts)
    assert [c.prompt_index for c in comps] == [0, 0, 1, 1]
    assert calls == [4, 4, 4]  # every turn of every conversation in one engine call
    observation = tok.encode("12+34=", add_special_tokens=False)
    for c in comps:
        assert c.meta["turns"] == 3 and len(c.loss_mask) == len(c.completion_ids) == len(c.logprobs)
        # sampled turn, observation, sampled turn, observation, sampled turn: the observation ids exactly, masked
        masked = [t for t, m in zip(c.completion_ids, c.loss_mask) if m == 0]
        assert masked == observation * 2
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if m == 0)
    ours, theirs = trainer_logprobs(tiny_model, comps)
    assert sum(len(t) for t in ours) == sum(c.sampled_tokens for c in comps)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) <= 1e-5


def test_a_retokenized_conversation_fails_the_exactness_check(parts, tiny_model):
    """What the loop must not do: rebuild the rows from their text. The tokens trained on are then not the ones
    sampled, and the trainer's logprobs no longer match the sampler's."""
    tok, _ = parts
    comps, _ = conversations(parts, [tok.encode("12+34="), tok.encode("56+7=")])
    redone = []
    for c in comps:
        ids = tok.encode(tok.decode(c.completion_ids), add_special_tokens=False)
        keep = len(ids)
        redone.append(Completion(c.prompt_ids, ids, (c.logprobs + [0.0] * keep)[:keep], c.text, c.finish_reason,
                                 c.prompt_index, loss_mask=([1] * keep)))
    assert any(r.completion_ids != c.completion_ids for r, c in zip(redone, comps))
    ours, theirs = trainer_logprobs(tiny_model, redone)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) > 1e-3


def test_an_observation_carries_no_gradient(tiny_model):
    """Two conversations alike but for their last observation (other tool output, same length): the update is the
    same to the bit. (An observation before a sampled turn rightly changes that turn's logprobs: it is its context.)"""
    def rows(observation: list[int]) -> Samples:
        comps = [Completion([5, 6, 7], [20, 21, 22] + observation, [-1.0, -2.0, -0.5] + [0.0] * len(observation), "",
                            "length", 0, loss_mask=[1, 1, 1] + [0] * len(observation)),
                 Completion([5, 6, 7], [30, 31], [-0.7, -1.1], "", "stop", 0)]
        return Samples.of_call(comps)

    def update(samples: Samples) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        policy = Policy(str(tiny_model), "float32", False, AlgoConfig(kl_coef=0.05), OptimConfig(lr=1e-2), 1, 1.0, 64,
                        old_logprobs=OldLogprobs.RECOMPUTED)
        step = policy.prepare([make_micro_batches(samples, 4096, 0)], len(samples))
        policy.update(step, torch.tensor([1.0, -1.0]))
        return {n: p.detach().clone() for n, p in policy.model.named_parameters()}

    a, b = update(rows([40, 41, 42, 43])), update(rows([90, 91, 92, 93]))
    assert all(torch.equal(a[n], b[n]) for n in a)
    # the same rows with the observation counted as sampled (masking broken) train differently
    broken = rows([90, 91, 92, 93])
    broken.completions[0].loss_mask = None
    c = update(broken)
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_limits_end_every_conversation(parts):
    tok, _ = parts
    prompts = [tok.encode("12+34=")]
    # a tool called forever: max_turns ends it, truncated
    comps, calls = conversations(parts, prompts, lambda: Echo(turns=10 ** 6), TurnLimits(4, 1000))
    assert [c.meta["turns"] for c in comps] == [4, 4] and {c.finish_reason for c in comps} == {"length"}
    assert calls == [2, 2, 2, 2]
    # a 1 MB observation: the token limit cuts it and ends the conversation
    comps, _ = conversations(parts, prompts, lambda: Echo(turns=5, observation="7" * (1 << 20)), TurnLimits(5, 40))
    assert all(len(c.completion_ids) == 40 and c.finish_reason == "length" for c in comps)
    assert all(c.meta["turns"] == 1 for c in comps)
    # errors are counted per kind, and the share of environment tokens reported
    comps, _ = conversations(parts, prompts, lambda: Echo(turns=2, error="timeout"), TurnLimits(3, 64))
    stats = conversation_stats(comps)
    assert stats["multiturn/tool_errors/timeout"] == 2 and stats["multiturn/tool_calls_mean"] == 1.0
    assert 0 < stats["multiturn/masked_frac"] < 1 and stats["multiturn/turns_mean"] == 2.0


def echo_env(turns: int = 2, observation: str = "12+34=", reward: float | None = None) -> Echo:
    """A plugin environment for the runs below (`env.name: test_multiturn:echo_env`)."""
    return Echo(turns, observation, reward=reward)


def run_config(model, out, *extra: str):
    from tandem.config import load_config

    return load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=2", "run.save_every=0", "run.progress=false",
        "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=2",
        "rollout.max_new_tokens=4", "data.max_prompt_tokens=8", "batch.micro_batch_tokens=256", "optim.lr=1e-2",
        "data.eval_size=4", "reward_pool.workers=0", "env.name=test_multiturn:echo_env", "env.kwargs={turns: 3}",
        "env.max_tokens=64",
        "rollout.max_logprob_diff=1e-5", "rollout.ignore_eos=true",  # every conversation takes its 3 turns
        "rewards=[{name: 'toy_rewards:text_length'}]", *extra])


def test_a_multi_turn_run_trains_on_its_sampled_tokens(tiny_model, tmp_path):
    """GRPO on whole conversations in one process: every step's sampler logprobs equal the trainer's over the sampled
    tokens (the run stops otherwise), the metrics count turns, calls and the masked share, evaluation reports tool
    use."""
    import json
    import sys
    from pathlib import Path

    from tandem.trainer import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # toy_rewards
    out = tmp_path / "run"
    summary = train(run_config(tiny_model, out, "env.kwargs={turns: 3, reward: 0.5}"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    # the environment's own reward is added to the reward functions'
    assert all(r["reward/env"] == 0.5 and r["reward/mean"] == pytest.approx(
        r["reward/toy_rewards:text_length"] + 0.5) for r in rows)
    assert all(r["logprob_diff_max"] <= 1e-5 for r in rows)
    assert all(r["multiturn/turns_mean"] == 3 and r["multiturn/tool_calls_mean"] == 2 for r in rows)
    assert all(0 < r["multiturn/masked_frac"] < 1 for r in rows)
    assert summary["eval/tool_call_frac"] == 1.0


def test_a_bad_environment_is_refused_before_any_model_loads(tiny_model, tmp_path, monkeypatch):
    from tandem import modeling
    from tandem.trainer import start_run

    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(KeyError, match="toolz"):
        start_run(run_config(tiny_model, tmp_path / "a", "env.name=toolz"), claim_output_dir=False)
    with pytest.raises(TypeError, match="turnz"):
        start_run(run_config(tiny_model, tmp_path / "b", "env.kwargs={turnz: 3}"), claim_output_dir=False)


def test_a_prompt_with_images_is_refused_not_sampled_without_them(parts):
    """A conversation's turns are sampled from ids alone: a prompt that brings images is refused, naming them and
    env.name, before any turn runs (red if they were dropped silently)."""
    pictured = ModelPrompt([5, 6, 7], Images("k", ("red.png",), {}))
    with pytest.raises(ValueError, match=r"prompt 1 holds images \(red\.png\).*env\.name"):
        conversations(parts, [ModelPrompt([5, 6, 7]), pictured])
