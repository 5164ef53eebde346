"""A sampler's side of the streaming schedule: groups of requests kept in flight on one engine, each handed out
whole when its last request stops, the staleness bound kept per token as new weights land."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Hashable, Iterator

from tandem.config import Config
from tandem.rollout import Completion, ModelPrompt, Sampling
from tandem.rollout.hf import HFEngine
from tandem.rollout.multiturn import Conversation, TurnLimits, Turns
from tandem.rollout.hf.stream import HFStream
from tandem.rollout.requests import Finished, Request
from tandem.rollout.vllm.server import VLLMServerEngine
from tandem.rollout.vllm.stream import ServerStream, VLLMStream

log = logging.getLogger("tandem.stream")
DROP_RESTARTS = 8  # rollout.partial: drop: a request begun again this many times stops the run (it cannot finish)
TOOL_THREADS = 4  # environments answering turns at once (a tool call runs beside the decoding, not in its way)
TOOL_POLL_S = 0.01  # nothing to decode but tool calls running: how long a step waits for one to answer


@dataclass(frozen=True)
class StreamGroup:
    """One prompt to sample a group for: `n` requests seeded `seed`, `seed + 1`, ..., each up to `max_new_tokens`.
    `serial` is the controller's number for it (unique in the run)."""

    serial: int
    prompt: ModelPrompt
    n: int
    seed: int
    max_new_tokens: int


@dataclass
class StreamReport:
    """What `StreamSampler.take` hands the controller: the groups finished since the last take (serial and its
    completions, in sample order) and the sampler's time since then."""

    groups: list[tuple[int, list[Completion]]]
    busy_seconds: float  # decoding
    idle_seconds: float  # nothing in flight
    load_seconds: float  # loading new weights and prefilling the requests in flight again
    in_flight: int  # requests running or waiting, after these groups left
    tokens_in_flight: int  # tokens sampled so far by the groups not yet handed out
    restarted: int  # requests begun again because the staleness bound left their first tokens behind
    version: int  # the policy version the engine holds now


def session(engine, sampling: Sampling, slots: int) -> HFStream | VLLMStream | ServerStream:
    """The streaming session of `engine`: the hf engine's slot decoder, the in-process vLLM engine's scheduler, or
    a vLLM server's streamed requests."""
    if isinstance(engine, HFEngine):
        return HFStream(engine, sampling, slots)
    if isinstance(engine, VLLMServerEngine):
        return ServerStream(engine, sampling, slots)
    return VLLMStream(engine, sampling, slots)


class StreamSampler:
    """Keeps up to `rollout.max_in_flight` requests decoding on one engine (`HFStream`, `VLLMStream`), adding the
    requests of new groups as slots free up; a group leaves whole, once all its `n` requests have stopped.

    New weights (`weights_changed`) land between two decode steps: the requests in flight keep their tokens (each
    tagged with the version that sampled it) and go on under the new weights, their prefixes prefilled again. With
    `rollout.partial: drop` a request whose first token is older than `placement.max_staleness` versions begins
    again (so does a finished request still waiting for the rest of its group), since no step could train it within
    the bound; with `resume` (the default) it is kept and the controller masks its tokens beyond the bound. With
    `rollout.in_flight_weights: false` new weights wait until the requests in flight have stopped: no new request
    starts meanwhile (`hold`), so every sequence is sampled by one version.

    With a multi-turn environment (`env.name`) each of a group's `n` requests is a conversation (`Turns`): a turn is
    one request; when it stops, the conversation's environment answers it on a thread of its own (a tool call never
    holds up the decoding) and its next turn joins the requests waiting, its prefix the conversation so far. Each
    turn is one request, so under `in_flight_weights: false` each turn (not each conversation) is sampled by one
    version; the environment's tokens carry the version the engine held when they were appended."""

    def __init__(self, cfg: Config, engine):
        self.cfg, self.engine = cfg, engine
        r, pl = cfg.rollout, cfg.placement
        self.slots = r.max_in_flight or cfg.batch.prompts_per_step * cfg.batch.group_size
        self.max_staleness, self.drop = pl.max_staleness, r.partial == "drop"
        self.session: HFStream | VLLMStream | ServerStream | None = None
        self.groups: dict[int, tuple[StreamGroup, dict[int, Completion]]] = {}
        self.outbox: list[tuple[int, list[Completion]]] = []
        self.version = 0
        self.reported_version = 0  # the version the last take reported
        self.lock = threading.RLock()  # one engine: a step, a weight load and an evaluation's generate take turns
        self._times = {"busy": 0.0, "idle": 0.0, "load": 0.0}
        self._restarted = 0
        self._warned = False
        self._last = time.perf_counter()
        self.turns: Turns | None = None  # multi-turn: how conversations take turns (made with the first groups)
        self.conversations: dict[Hashable, tuple[Conversation, list[int]]] = {}  # key -> it, its ids' versions
        self.answering: dict[Hashable, tuple[Future, Request]] = {}  # turns an environment is answering
        self._tools: ThreadPoolExecutor | None = None

    def add(self, groups: list[StreamGroup], sampling: Sampling) -> None:
        for g in groups:
            if g.prompt.images is not None:  # a stream's requests are ids alone (a config is refused for it)
                raise ValueError(f"group {g.serial}'s prompt holds images ({', '.join(g.prompt.images.names)}), which "
                                 "placement.schedule: stream does not carry: its requests would be sampled without "
                                 "them. Use placement.schedule sync or async")
        with self.lock:
            if self.session is None:
                self._open(sampling)
            for g in groups:
                self.groups[g.serial] = (g, {})
                for i in range(g.n):
                    self._begin(g, i, restarts=0)

    def _open(self, sampling: Sampling) -> None:
        """The engine's session, and with a multi-turn environment the conversations' rules (their stop strings
        stop every request)."""
        env = self.cfg.env
        if env.name:
            from tandem.modeling import load_tokenizer
            from tandem.rollout.tools import make_environment

            tokenizer = load_tokenizer(self.cfg.model.path, self.cfg.model.trust_remote_code)  # ids as the trainer's
            make_env = functools.partial(make_environment, env.name, **env.kwargs)
            self.turns = Turns(tokenizer, sampling, make_env, TurnLimits(env.max_turns, self.cfg.max_completion_tokens))
            sampling = dataclasses.replace(sampling, stop=self.turns.stop)
            self._tools = ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tandem-tool")
        self.session = session(self.engine, sampling, self.slots)

    def _begin(self, g: StreamGroup, i: int, restarts: int) -> Request:
        """Request `i` of group `g` from its prompt (a conversation: its first turn, on a fresh environment)."""
        key = (g.serial, i)
        if self.turns is None:
            r = Request(key, list(g.prompt.ids), g.max_new_tokens, g.seed + i, restarts=restarts)
        else:
            conv = self.turns.begin(0, g.prompt, g.seed + i)
            self.conversations[key] = (conv, [self.version] * len(conv.ids))
            r = self._turn(key, conv, restarts)
        self.session.add(r)
        return r

    def _turn(self, key: Hashable, conv: Conversation, restarts: int) -> Request:
        """The request of `conv`'s next turn."""
        turn = self.turns.next_turn(conv)
        return Request(key, conv.prefix, turn.max_new_tokens, turn.seeds[0], restarts=restarts)

    @property
    def in_flight(self) -> int:
        """Requests running or waiting, and turns an environment is answering."""
        return (self.session.in_flight if self.session is not None else 0) + len(self.answering)

    def hold(self, holding: bool) -> None:
        """Stop (or go on) starting new requests: the sampler drains before a load that waits for it."""
        if self.session is not None:
            self.session.admitting = not holding

    @property
    def running(self) -> int:
        return len(self.session.running) if self.session is not None else 0

    def step(self) -> bool:
        """One decode step of every running request; False when nothing is in flight (the time counts as idle, as
        does a wait for an environment's answer with nothing to decode)."""
        with self.lock:
            now = time.perf_counter()
            self._answered()
            if not self.session or not self.session.in_flight:
                if self.answering:
                    wait([f for f, _ in self.answering.values()], TOOL_POLL_S, FIRST_COMPLETED)
                    self._answered()
                end = time.perf_counter()
                self._times["idle"] += end - self._last  # since the last step: nothing was decoding
                self._last = end
                return bool(self.in_flight)
            for f in self.session.step(self.version):
                self._finish(f)
            self._last = time.perf_counter()
            self._times["busy"] += self._last - now
            return True

    def _finish(self, f: Finished) -> None:
        r = f.request
        if r.key in self.conversations:  # a turn: the environment answers it beside the decoding
            conv, _ = self.conversations[r.key]
            turn = Completion(list(r.prompt_ids), list(r.tokens), list(r.logprobs), f.text, f.finish_reason, 0)
            self.answering[r.key] = (self._tools.submit(self.turns.take, conv, turn), r)
            return
        self._done(r.key, Completion(list(r.prompt_ids), list(r.tokens), list(r.logprobs), f.text, f.finish_reason,
                                     prompt_index=0, versions=list(r.versions)))

    def _answered(self) -> None:
        """Each turn its environment has answered: its conversation's next turn queued, or the conversation done."""
        for key in [k for k, (fut, _) in self.answering.items() if fut.done()]:
            fut, r = self.answering.pop(key)
            fut.result()  # an environment that raised stops the stream (a tool's own failure is an answer)
            conv, versions = self.conversations[key]
            versions += r.versions + [self.version] * (len(conv.ids) - len(versions) - len(r.versions))
            if not conv.finish:
                self.session.add(self._turn(key, conv, r.restarts))
                continue
            del self.conversations[key]
            self._done(key, dataclasses.replace(self.turns.completion(conv), versions=versions))

    def _done(self, key: Hashable, completion: Completion) -> None:
        serial, i = key
        spec, done = self.groups[serial]
        done[i] = completion
        if len(done) == spec.n:
            del self.groups[serial]
            self.outbox.append((serial, [done[k] for k in range(spec.n)]))

    def suspend(self) -> None:
        """The engine free for other callers until the next `step` (`VLLMStream.suspend`: its requests out of vLLM's
        scheduler, their tokens kept)."""
        with self.lock:
            if self.session is not None:
                self.session.suspend()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The engine to a caller's own `generate` (an evaluation) between two decode steps; the requests in flight
        go on afterwards."""
        with self.lock:
            if self.session is None:
                yield
                return
            self.session.suspend()
            try:
                yield
            finally:
                self.session.resume()

    def weights_changed(self, version: int, load_seconds: float = 0.0) -> None:
        """The engine now holds policy `version`: the requests in flight go on under it (prefixes prefilled again);
        under `partial: drop` those it leaves beyond the staleness bound begin again."""
        with self.lock:
            start = time.perf_counter()
            self.version = version
            if self.session is None:
                return
            if self.drop:
                self._drop_stale(oldest=version - self.max_staleness)
            self.session.reload()
            self._times["load"] += load_seconds + time.perf_counter() - start
            self._last = time.perf_counter()

    def _drop_stale(self, oldest: int) -> None:
        """`partial: drop`: every request (a conversation: the whole of it) with a token older than `oldest` begins
        again, as does every finished one still waiting for its group. A turn an environment is answering is
        judged when its next turn is queued, at the next load."""
        for r in self.session.requests():
            before = self.conversations[r.key][1] if r.key in self.conversations else []  # its earlier turns'
            first = before[:1] or r.versions[:1]
            if first and first[0] < oldest:
                self.session.discard(r.key)
                serial, i = r.key
                self._starving(self._begin(self.groups[serial][0], i, restarts=r.restarts + 1))
                self._restarted += 1
        for spec, done in self.groups.values():
            for i in [i for i, c in done.items() if c.versions and c.versions[0] < oldest]:
                del done[i]
                self._begin(spec, i, restarts=1)
                self._restarted += 1

    def _starving(self, r: Request) -> None:
        """A request begun again once more: warned about at the third time, refused at the DROP_RESTARTS-th. Each
        restart means it ran through max_staleness + 1 updates without stopping, so it will not stop the next time
        either while the trainer keeps its pace: under `drop` it would hold its slot, and its group, for ever."""
        if r.restarts == 3 and not self._warned:
            self._warned = True
            log.warning("rollout.partial: drop has begun a request again 3 times: it needs more decoding than "
                        "placement.max_staleness=%d updates allow, and may never finish; raise "
                        "placement.max_staleness or set rollout.partial: resume", self.max_staleness)
        if r.restarts >= DROP_RESTARTS:
            raise RuntimeError(
                f"rollout.partial: drop has begun a request again {r.restarts} times ({len(r.prompt_ids)} prompt "
                f"tokens, up to {r.max_new_tokens} new): it needs more decoding than placement.max_staleness="
                f"{self.max_staleness} updates allow, so it would never finish and its group would never train. "
                "Set rollout.partial: resume (its tokens beyond the bound are masked, the rest trained), or raise "
                "placement.max_staleness")

    def take(self) -> StreamReport:
        """The groups finished since the last take, and the time since."""
        with self.lock:
            out, self.outbox = self.outbox, []
            t, self._times = self._times, {"busy": 0.0, "idle": 0.0, "load": 0.0}
            restarted, self._restarted = self._restarted, 0
            self.reported_version = self.version
            return StreamReport(out, t["busy"], t["idle"], t["load"], self.in_flight, self._tokens_in_flight(),
                                restarted, self.version)

    def _tokens_in_flight(self) -> int:
        """Tokens sampled (and appended) so far by the groups not yet handed out."""
        turns = self.session.requests() if self.session is not None else []
        return (sum(len(r.tokens) for r in turns) + sum(len(r.tokens) for _, r in self.answering.values())
                + sum(len(conv.ids) for conv, _ in self.conversations.values())
                + sum(len(c.completion_ids) for _, done in self.groups.values() for c in done.values()))

    def close(self) -> None:
        """No request left in the engine (a server's connections closed before the server goes), and no environment
        answers another turn (one answering now ends within its tool's own time bound)."""
        if self.session is not None:
            self.session.suspend()
        if self._tools is not None:
            self._tools.shutdown(wait=False, cancel_futures=True)
