"""Multi-turn rollouts: engine and environment take turns, token ids in and out, the environment's tokens masked."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from tandem.rollout.base import Completion, Sampling

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
class _Conversation:
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


def converse(engine, tokenizer, prompts: list[list[int]], sampling: Sampling, make_env: Callable[[], object],
             limits: TurnLimits) -> list[Completion]:
    """`sampling.n` conversations per prompt, grouped by prompt as `generate` returns them. Each turn continues from
    the exact ids so far: earlier turns are never re-tokenized. An engine with `generate_continuous` (vLLM) runs all
    conversations as one continuous batch, each next turn queued as its last one ends; any other gets every turn of
    every conversation still going as one batch (a generate call per distinct token budget). The environment's text
    is tokenized once, appended, and masked out of training (`Completion.loss_mask`); its logprobs are 0.

    `make_env()` gives one environment per conversation (`tandem.rollout.tools.Environment`); the engine stops a turn
    at `sampling.stop` and the environment's stop strings.
    """
    # the model answers with EOS, unless the sampling ignores it (then an EOS token is just a token, as in one turn)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None and not sampling.ignore_eos else set()
    convs: list[_Conversation] = []
    for i, prompt in enumerate(prompts):
        first = sampling.seeds[i] if sampling.seeds else (sampling.seed or 0) + i * sampling.n
        for k in range(sampling.n):
            env = make_env()
            conv = _Conversation(i, list(prompt), first + k, env)
            opening = env.reset(tokenizer.decode(prompt))
            if opening:
                conv.append(_encode(tokenizer, opening), None)
            convs.append(conv)
    stop = tuple(dict.fromkeys(tuple(sampling.stop) + tuple(getattr(convs[0].env, "stop", ()) if convs else ())))

    def next_turn(c: _Conversation) -> Sampling:
        return replace(sampling, n=1, max_new_tokens=min(sampling.max_new_tokens, limits.max_tokens - len(c.ids)),
                       stop=stop, seed=None if sampling.seed is None else c.seed + _TURN_SEED_STRIDE * c.turns,
                       seeds=(c.seed + _TURN_SEED_STRIDE * c.turns,))

    if hasattr(engine, "generate_continuous"):  # vLLM: a conversation's next turn starts as soon as its last ends
        def follow(k: int, out: Completion):
            _take_turn(convs[k], out, tokenizer, eos, limits)
            return None if convs[k].finish else (convs[k].prompt + convs[k].ids, next_turn(convs[k]))

        engine.generate_continuous([(c.prompt + c.ids, next_turn(c)) for c in convs], follow)
        return [_completion(c, tokenizer) for c in convs]
    while True:  # any other engine: each turn of every conversation still going, one batch
        active = [c for c in convs if not c.finish]
        if not active:
            break
        by_budget: dict[int, list[tuple[_Conversation, Sampling]]] = {}
        for c in active:
            turn = next_turn(c)
            by_budget.setdefault(turn.max_new_tokens, []).append((c, turn))
        for pairs in by_budget.values():
            group = [c for c, _ in pairs]
            turn = replace(pairs[0][1], seeds=tuple(t.seeds[0] for _, t in pairs))
            outs = engine.generate([c.prompt + c.ids for c in group], turn)
            for c, out in zip(group, outs):
                _take_turn(c, out, tokenizer, eos, limits)
    return [_completion(c, tokenizer) for c in convs]


def _take_turn(c: _Conversation, out: Completion, tokenizer, eos: set[int], limits: TurnLimits) -> None:
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


def _completion(c: _Conversation, tokenizer) -> Completion:
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
