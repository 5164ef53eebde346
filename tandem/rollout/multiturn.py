"""Multi-turn rollouts: engine and environment take turns, token ids in and out, the environment's tokens masked."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from tandem.rollout.base import Completion, Sampling
from tandem.samples import ModelPrompt, model_prompts

# Seeds of a conversation's turns are spaced this far apart, so that turn t of one conversation never reuses the seed
# of another conversation's turn.
_TURN_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class TurnLimits:
    """Where a conversation is cut: `max_turns` sampled turns, `max_tokens` completion tokens in all (sampled and
    appended). A conversation cut by either ends with finish_reason "length" (truncated, as a single-turn answer at
    max_new_tokens is), so `algo.mask_truncated` and the overlong shaping treat it alike."""

    max_turns: int
    max_tokens: int


@dataclass
class Conversation:
    """One conversation so far: its completion ids (sampled and appended), their logprobs (0 where appended) and loss
    mask (1 where sampled), and what the environment said of it."""

    prompt_index: int
    prompt: list[int]
    seed: int
    env: object
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    env_reward: float | None = None
    finish: str = ""  # "" while it goes on; then "stop" or "length"
    # MoE: the last turn's routes (`Completion.routes`), which cover every position before its last sampled token
    routes: object = None

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    @property
    def prefix(self) -> list[int]:
        """What the next turn continues: the prompt and every id since, never re-tokenized."""
        return self.prompt + self.ids


class Turns:
    """How conversations take turns, for `converse` and the streaming schedule alike: each begins with its own
    environment's opening, its turn t is sampled with seed `seed + _TURN_SEED_STRIDE * t` up to the tokens the
    limits leave, and stops at the sampling's and the environment's stop strings (`stop`)."""

    def __init__(self, tokenizer, sampling: Sampling, make_env: Callable[[], object], limits: TurnLimits):
        self.tokenizer, self.sampling, self.make_env, self.limits = tokenizer, sampling, make_env, limits
        # the model answers with EOS, unless the sampling ignores it (then an EOS token is just a token, as in one turn)
        eos = tokenizer.eos_token_id
        self.eos = {eos} if eos is not None and not sampling.ignore_eos else set()
        self._spare = make_env()  # the first conversation's, made now for its stop strings
        self.stop = tuple(dict.fromkeys(tuple(sampling.stop) + tuple(getattr(self._spare, "stop", ()))))

    def begin(self, prompt_index: int, prompt: ModelPrompt, seed: int) -> Conversation:
        """A new conversation on a fresh environment, its opening (if any) appended. A prompt with images is refused:
        its turns would be sampled without them (a run's config is refused for it before any model loads)."""
        if prompt.images is not None:
            raise ValueError(f"prompt {prompt_index} holds images ({', '.join(prompt.images.names)}), which a "
                             "multi-turn conversation (env.name) does not carry: its turns would be sampled without "
                             "them. Train a vision-language model without env.name")
        env, self._spare = self._spare or self.make_env(), None
        conv = Conversation(prompt_index, list(prompt.ids), seed, env)
        opening = env.reset(self.tokenizer.decode(conv.prompt))
        if opening:
            conv.append(_encode(self.tokenizer, opening), None)
        return conv

    def next_turn(self, c: Conversation) -> Sampling:
        """The sampling of `c`'s next turn: one sample, its seed, the tokens the limits leave, every stop string."""
        seed = c.seed + _TURN_SEED_STRIDE * c.turns
        budget = min(self.sampling.max_new_tokens, self.limits.max_tokens - len(c.ids))
        return replace(self.sampling, n=1, stop=self.stop, seed=None if self.sampling.seed is None else seed,
                       seeds=(seed,), max_new_tokens=budget)

    def take(self, c: Conversation, out: Completion) -> None:
        """The sampled turn `out` appended to `c`; the environment answers it; whether `c` goes on (`c.finish`)."""
        _take_turn(c, out, self.tokenizer, self.eos, self.limits)

    def completion(self, c: Conversation) -> Completion:
        return _completion(c, self.tokenizer)


def converse(engine, tokenizer, prompts: Sequence[ModelPrompt | Sequence[int]], sampling: Sampling,
             make_env: Callable[[], object], limits: TurnLimits) -> list[Completion]:
    """`sampling.n` conversations per prompt, grouped by prompt as `generate` returns them. Each turn continues from
    the exact ids so far: earlier turns are never re-tokenized. An engine with `generate_continuous` (vLLM) runs all
    conversations as one continuous batch, each next turn queued as its last one ends; any other gets every turn of
    every conversation still going as one batch (a generate call per distinct token budget). The environment's text
    is tokenized once, appended, and masked out of training (`Completion.loss_mask`); its logprobs are 0.

    `make_env()` gives one environment per conversation (`tandem.rollout.tools.Environment`); the engine stops a turn
    at `sampling.stop` and the environment's stop strings.
    """
    turns = Turns(tokenizer, sampling, make_env, limits)
    convs: list[Conversation] = []
    for i, prompt in enumerate(model_prompts(prompts)):
        first = sampling.seeds[i] if sampling.seeds else (sampling.seed or 0) + i * sampling.n
        convs += [turns.begin(i, prompt, first + k) for k in range(sampling.n)]

    if hasattr(engine, "generate_continuous"):  # vLLM: a conversation's next turn starts as soon as its last ends
        def follow(k: int, out: Completion):
            turns.take(convs[k], out)
            return None if convs[k].finish else (convs[k].prefix, turns.next_turn(convs[k]))

        engine.generate_continuous([(c.prefix, turns.next_turn(c)) for c in convs], follow)
        return [turns.completion(c) for c in convs]
    while True:  # any other engine: each turn of every conversation still going, one batch
        active = [c for c in convs if not c.finish]
        if not active:
            break
        by_budget: dict[int, list[tuple[Conversation, Sampling]]] = {}
        for c in active:
            turn = turns.next_turn(c)
            by_budget.setdefault(turn.max_new_tokens, []).append((c, turn))
        for pairs in by_budget.values():
            group = [c for c, _ in pairs]
            turn = replace(pairs[0][1], seeds=tuple(t.seeds[0] for _, t in pairs))
            outs = engine.generate([c.prefix for c in group], turn)
            for c, out in zip(group, outs):
                turns.take(c, out)
    return [turns.completion(c) for c in convs]


def _take_turn(c: Conversation, out: Completion, tokenizer, eos: set[int], limits: TurnLimits) -> None:
    """Append the sampled turn; let the environment answer it; decide whether the conversation goes on."""
    c.append(list(out.completion_ids), list(out.logprobs))
    c.routes = out.routes
    c.turns += 1
    result = c.env.step(out.text)  # also on the last turn: an environment may reward the final answer
    if result.reward is not None:
        c.env_reward = (c.env_reward or 0.0) + float(result.reward)
    if result.done or (out.completion_ids and out.completion_ids[-1] in eos):  # EOS: the model has answered
        c.finish = "length" if out.finish_reason == "length" else "stop"
        return
    if result.tool is not None:  # counted where the loop answers the call
        c.tool_calls += 1
    if result.error is not None:
        c.tool_errors.append(result.error)
    if c.turns >= limits.max_turns:
        c.finish = "length"  # cut with a call unanswered
        return
    observation = _encode(tokenizer, result.observation) if result.observation else []
    room = limits.max_tokens - len(c.ids)
    if len(observation) >= room:  # no room for the observation and a next turn
        c.append(observation[:room], None)
        c.finish = "length"
        return
    c.append(observation, None)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _completion(c: Conversation, tokenizer) -> Completion:
    return Completion(
        prompt_ids=c.prompt, completion_ids=c.ids, logprobs=c.logprobs,
        text=tokenizer.decode(c.ids, skip_special_tokens=True), finish_reason=c.finish, prompt_index=c.prompt_index,
        meta={"turns": c.turns, "tool_calls": c.tool_calls, "tool_errors": c.tool_errors,
              "env_reward": c.env_reward},
        loss_mask=c.mask, routes=c.routes)


def conversation_stats(completions: list[Completion]) -> dict[str, float]:
    """A step's multi-turn metrics: turns and tool calls per conversation, tool errors by kind (counted, never
    silent), and the share of completion tokens the environment wrote (masked out of training)."""
    n = max(len(completions), 1)
    tokens = sum(len(c.completion_ids) for c in completions)
    out = {"multiturn/turns_mean": sum(c.meta.get("turns", 1) for c in completions) / n,
           "multiturn/tool_calls_mean": sum(c.meta.get("tool_calls", 0) for c in completions) / n,
           "multiturn/tool_call_frac": sum(c.meta.get("tool_calls", 0) > 0 for c in completions) / n,
           "multiturn/masked_frac": (tokens - sum(c.sampled_tokens for c in completions)) / max(tokens, 1),
           "multiturn/tool_errors": float(sum(len(c.meta.get("tool_errors", ())) for c in completions))}
    for c in completions:
        for kind in c.meta.get("tool_errors", ()):
            out[f"multiturn/tool_errors/{kind}"] = out.get(f"multiturn/tool_errors/{kind}", 0.0) + 1
    return out
