"""The streaming schedule on the in-process vLLM engine: requests added and finished between engine steps, and weights
landing with requests in flight (each one aborted and resubmitted with its tokens so far, prefilled again)."""
from __future__ import annotations

import itertools
from typing import Hashable

from tandem.rollout.base import Sampling
from tandem.rollout.stream import Finished, Request, StreamRequests
from tandem.rollout.vllm.engine import VLLMEngine
from tandem.rollout.vllm.sampling import _engine_only_kwargs, _finish, _sampling_kwargs


class VLLMStream(StreamRequests):
    """`tandem.rollout.stream.HFStream`'s session on a `VLLMEngine` (mode inprocess): up to `slots` requests in vLLM's
    scheduler at once, one `step` being one vLLM engine step (a token for each decoding request).

    `reload()` after the engine's weights change: every running request is aborted and submitted again with its
    prompt and tokens so far as its prompt, so its keys and values are computed again under the new weights and the
    tokens it samples next come from exactly the new policy (the trainer's logprobs of them equal the sampler's), as
    slime's and AReaL's partial rollouts do; the tokens before keep the version that sampled them. The other way,
    keeping the old weights' cache and correcting by importance weights (PipelineRL), leaves those logprobs apart."""

    def __init__(self, engine: VLLMEngine, sampling: Sampling, slots: int):
        if not isinstance(engine, VLLMEngine):
            raise ValueError("VLLMStream streams on the in-process vLLM engine (rollout.vllm.mode: inprocess)")
        super().__init__()
        self.engine, self.sampling, self.slots = engine, sampling, slots
        self.suspended = False  # the running requests are out of vLLM's scheduler (`suspend`)
        self._submitted: dict[str, tuple[Hashable, int]] = {}  # vLLM request id -> (key, tokens it held then)
        self._ids = itertools.count()

    def discard(self, key: Hashable) -> None:
        """Forget a request (running or waiting)."""
        if key in self.running:
            self._abort([key])
            del self.running[key]
        self._unqueue(key)

    def suspend(self) -> None:
        """Every running request out of vLLM's scheduler, its tokens kept (`reload` submits them again): the engine's
        `generate` runs vLLM until its scheduler is empty, and would otherwise take the stream's requests along;
        and a sleeping engine must hold no request."""
        self._abort(list(self.running))
        self.suspended = True

    def resume(self) -> None:
        """The running requests back into vLLM's scheduler after a `suspend`, each from its prefix."""
        if self.suspended:
            self.reload()

    def reload(self) -> None:
        """The engine's weights changed: every running request again from its prefix, under the new weights."""
        self._abort(list(self.running))
        if not self.engine.llm.reset_prefix_cache():  # the old weights' cached prefixes, none held now
            raise RuntimeError("vLLM kept its prefix cache after every request was aborted")
        self.suspended = False
        for r in self.running.values():
            self._submit(r)

    def step(self, version: int) -> list[Finished]:
        """Admit waiting requests into free slots, then one engine step; its new tokens tagged `version`; the requests
        that stopped."""
        self.resume()
        while self.admitting and self.waiting and len(self.running) < self.slots:
            r = self.waiting.popleft()
            self.running[r.key] = r
            self._submit(r)
        if not self.running:
            return []
        done = []
        with self.engine._engine_context():
            outputs = self.engine.llm.llm_engine.step()
        for out in outputs:
            if out.request_id not in self._submitted:
                continue  # aborted since
            key, held = self._submitted[out.request_id]
            r, (c,) = self.running[key], out.outputs
            new = list(c.token_ids)[len(r.tokens) - held:]
            at = len(c.token_ids) - len(new)
            r.tokens += new
            r.logprobs += [float(c.logprobs[at + j][t].logprob) for j, t in enumerate(new)]
            r.versions += [version] * len(new)
            if out.finished:
                del self._submitted[out.request_id], self.running[key]
                text = self.engine.tokenizer.decode(r.tokens, skip_special_tokens=True)
                if c.finish_reason == "stop" and isinstance(c.stop_reason, str):  # cut just after the stop string
                    text = text[: text.find(c.stop_reason) + len(c.stop_reason)]
                done.append(Finished(r, _finish(c.finish_reason, f"stream request {key}"), text))
        return done

    def _submit(self, r: Request) -> None:
        """`r` into vLLM's scheduler: its prefix as the prompt, the tokens it has left as its limit, one sample."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(r.prefix) >= self.engine.max_model_len:
            raise ValueError(f"stream request {r.key}: {len(r.prefix)} tokens; max_model_len is "
                             f"{self.engine.max_model_len}")
        # A request resubmitted after a weight load draws on from a seed of its own (its tokens so far counted in).
        seed = r.seed + 7919 * r.restarts + 104729 * len(r.tokens)
        kwargs = dict(_sampling_kwargs(self.sampling, 1, seed), max_tokens=r.max_new_tokens - len(r.tokens))
        rid = f"tandem-stream-{next(self._ids)}"
        self.engine.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=r.prefix),
                                               SamplingParams(**kwargs, **_engine_only_kwargs(self.sampling)),
                                               lora_request=self.engine.lora_request)
        self._submitted[rid] = (r.key, len(r.tokens))

    def _abort(self, keys: list[Hashable]) -> None:
        rids = [rid for rid, (key, _) in self._submitted.items() if key in keys]
        if rids:
            self.engine.llm.llm_engine.abort_request(rids)
        for rid in rids:
            del self._submitted[rid]
