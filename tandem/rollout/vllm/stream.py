"""The streaming schedule on vLLM, in process or a server: requests added and finished between engine steps, and weights
landing with requests in flight (each one aborted and resubmitted with its tokens so far, prefilled again)."""
from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
import time
from typing import Hashable

from tandem.rollout.base import Sampling
from tandem.rollout.requests import Finished, Request, StreamRequests
from tandem.rollout.vllm.engine import VLLMEngine
from tandem.rollout.vllm.sampling import checked_finish, engine_only_kwargs, sampling_kwargs


class _Resubmitting(StreamRequests):
    """What both vLLM sessions share: their requests leave vLLM (`suspend`) and come back from their prefixes
    (`reload`), each resubmission drawing from a seed of its own, and a finished request's text cut as vLLM cuts it."""

    def __init__(self, engine, sampling: Sampling, slots: int):
        super().__init__()
        self.engine, self.sampling, self.slots = engine, sampling, slots
        self.suspended = False  # the running requests are out of vLLM (`suspend`)

    def resume(self) -> None:
        """The running requests back into vLLM after a `suspend`, each from its prefix."""
        if self.suspended:
            self.reload()

    def reload(self) -> None:
        """Every running request again from its prefix, under the engine's weights now (each session's own way)."""
        raise NotImplementedError

    @staticmethod
    def _seed(r: Request) -> int:
        """A request resubmitted after a weight load draws on from a seed of its own (its tokens so far counted in)."""
        return r.seed + 7919 * r.restarts + 104729 * len(r.tokens)

    @staticmethod
    def _finished(r: Request, tokenizer, reason: str | None, stop_reason) -> Finished:
        """`r` stopped: its text decoded from its ids, cut just after the stop string it stopped at."""
        text = tokenizer.decode(r.tokens, skip_special_tokens=True)
        if reason == "stop" and isinstance(stop_reason, str):
            text = text[: text.find(stop_reason) + len(stop_reason)]
        return Finished(r, checked_finish(reason, f"stream request {r.key}"), text)


class VLLMStream(_Resubmitting):
    """`tandem.rollout.hf.HFStream`'s session on a `VLLMEngine` (mode inprocess): up to `slots` requests in vLLM's
    scheduler at once, one `step` being one vLLM engine step (a token for each decoding request).

    `reload()` after the engine's weights change: every running request is aborted and submitted again with its
    prompt and tokens so far as its prompt, so its keys and values are computed again under the new weights and the
    tokens it samples next come from exactly the new policy (the trainer's logprobs of them equal the sampler's), as
    slime's and AReaL's partial rollouts do; the tokens before keep the version that sampled them. The other way,
    keeping the old weights' cache and correcting by importance weights (PipelineRL), leaves those logprobs apart."""

    def __init__(self, engine: VLLMEngine, sampling: Sampling, slots: int):
        if not isinstance(engine, VLLMEngine):
            raise ValueError("VLLMStream streams on the in-process vLLM engine (rollout.vllm.mode: inprocess)")
        super().__init__(engine, sampling, slots)
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
        for r in self._admit(self.slots):
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
                done.append(self._finished(r, self.engine.tokenizer, c.finish_reason, c.stop_reason))
        return done

    def _submit(self, r: Request) -> None:
        """`r` into vLLM's scheduler: its prefix as the prompt, the tokens it has left as its limit, one sample."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(r.prefix) >= self.engine.max_model_len:
            raise ValueError(f"stream request {r.key}: {len(r.prefix)} tokens; max_model_len is "
                             f"{self.engine.max_model_len}")
        kwargs = dict(sampling_kwargs(self.sampling, 1, self._seed(r)), max_tokens=r.max_new_tokens - len(r.tokens))
        rid = f"tandem-stream-{next(self._ids)}"
        self.engine.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=r.prefix),
                                               SamplingParams(**kwargs, **engine_only_kwargs(self.sampling)),
                                               lora_request=self.engine.lora_request)
        self._submitted[rid] = (r.key, len(r.tokens))

    def _abort(self, keys: list[Hashable]) -> None:
        rids = [rid for rid, (key, _) in self._submitted.items() if key in keys]
        if rids:
            self.engine.llm.llm_engine.abort_request(rids)
        for rid in rids:
            del self._submitted[rid]


STEP_WAIT_S = 0.05  # ServerStream.step: the longest it waits for a token to arrive before it returns empty-handed
RESET_TIMEOUT_S = 30.0  # ServerStream.reload: how long the server may take to free the aborted requests' blocks


class ServerStream(_Resubmitting):
    """`VLLMStream`'s session on a vLLM server (`VLLMServerEngine`): each running request is one streamed
    /v1/completions request on a thread of its own, and a `step` hands on the tokens that arrived since the last one
    (waiting up to STEP_WAIT_S for one), tagged with the version the sampler holds.

    New weights land the same way: `suspend` (before the load) closes every request's connection, which makes the
    server abort it, and keeps the tokens that arrived; `reload` (after it) waits until the server's prefix cache is
    reset (it fails while an aborted request still holds blocks, which would otherwise serve the old weights' keys and
    values to the resubmission) and submits every running request again with its tokens so far as its prompt."""

    def __init__(self, engine, sampling: Sampling, slots: int):
        from tandem.modeling import load_tokenizer
        from tandem.rollout.vllm.server import VLLMServerEngine

        if not isinstance(engine, VLLMServerEngine):
            raise ValueError("ServerStream streams on a vLLM server (rollout.vllm.mode: server)")
        super().__init__(engine, sampling, slots)
        self.tokenizer = load_tokenizer(engine.model_path)  # the finished texts, decoded from the ids as vLLM does
        self.version = 0  # the version of the last step: what tokens that arrive before a load were sampled by
        self._calls: dict[Hashable, _StreamedCall] = {}
        self._inbox: dict[Hashable, list[tuple]] = {}  # key -> chunks arrived: (ids, logprobs, finish, stop reason)
        self._arrived = threading.Condition()
        self._stopped: list[Finished] = []  # requests whose last chunk `suspend` took: the next `step` hands them on

    @property
    def in_flight(self) -> int:
        return super().in_flight + len(self._stopped)

    def requests(self) -> list[Request]:
        return super().requests() + [f.request for f in self._stopped]

    def discard(self, key: Hashable) -> None:
        if key in self.running:
            self._stop([key])
            self._inbox.pop(key, None)
            del self.running[key]
        self._stopped = [f for f in self._stopped if f.request.key != key]
        self._unqueue(key)

    def suspend(self) -> None:
        """Every running request's connection closed (the server aborts it), the tokens it sent kept; a request that
        finished before its connection closed is handed on by the next `step`."""
        self._stop(list(self._calls))
        self._stopped += self._take(self.version)
        self.suspended = True

    def reload(self) -> None:
        """Every running request again from its prefix, under the server's weights now."""
        self.suspend()
        deadline = time.monotonic() + RESET_TIMEOUT_S
        while not (self.engine._post("/reset_prefix_cache") or {}).get("success"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server {self.engine.base_url} kept its prefix cache {RESET_TIMEOUT_S:.0f} s "
                                   "after the stream's requests were aborted: a request of another caller is running")
            time.sleep(0.01)
        self.suspended = False
        for r in self.running.values():
            self._submit(r)

    def step(self, version: int) -> list[Finished]:
        """Admit waiting requests, then the tokens that arrived (waiting up to STEP_WAIT_S for one), tagged
        `version`; the requests that stopped."""
        self.version = version
        self.resume()
        for r in self._admit(self.slots):
            self._submit(r)
        done, self._stopped = self._stopped, []
        if not self.running:
            return done
        with self._arrived:
            if not self._inbox and not done:
                self._arrived.wait(STEP_WAIT_S)
        return done + self._take(version)

    def _take(self, version: int) -> list[Finished]:
        with self._arrived:
            inbox, self._inbox = self._inbox, {}
        done = []
        for key, chunks in inbox.items():
            r = self.running[key]
            for ids, logprobs, finish, stop_reason in chunks:
                if isinstance(finish, BaseException):
                    raise RuntimeError(f"stream request {key} on vLLM server {self.engine.base_url}: {finish!r}") \
                        from finish
                r.tokens += ids
                r.logprobs += logprobs
                r.versions += [version] * len(ids)
                if finish is None:
                    continue
                call = self._calls.pop(key, None)  # (gone already when it finished as `suspend` closed it)
                if call is not None:
                    call.join()
                del self.running[key]
                done.append(self._finished(r, self.tokenizer, finish, stop_reason))
        return done

    def _submit(self, r: Request) -> None:
        body = self.engine.completion_body(r.prefix, self.sampling, 1, self._seed(r), r.max_new_tokens - len(r.tokens))
        call = _StreamedCall(self, r.key, dict(body, stream=True))
        self._calls[r.key] = call
        call.start()

    def _arrive(self, key: Hashable, chunk: tuple) -> None:
        with self._arrived:
            self._inbox.setdefault(key, []).append(chunk)
            self._arrived.notify_all()

    def _stop(self, keys: list[Hashable]) -> None:
        calls = [self._calls.pop(k) for k in keys if k in self._calls]
        for call in calls:
            call.stop()
        for call in calls:
            call.join()


class _StreamedCall(threading.Thread):
    """One streamed /v1/completions request: each chunk's new token ids and logprobs to its `ServerStream`, until
    the request finishes or `stop` closes its connection."""

    def __init__(self, stream: ServerStream, key: Hashable, body: dict):
        super().__init__(name=f"tandem-stream-call-{key}", daemon=True)
        from urllib.parse import urlparse

        url = urlparse(stream.engine.base_url)
        self.stream, self.key, self.body = stream, key, body
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=stream.engine.request_timeout_s)
        self.stopping = False

    def run(self) -> None:
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(self.body),
                              {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:2000]!r}")
            for line in resp:
                if self.stopping:
                    return
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                (choice,) = json.loads(line[6:])["choices"]
                ids = [int(t) for t in choice.get("token_ids") or ()]
                logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or ()]
                finish = choice.get("finish_reason")
                if ids or finish is not None:
                    self.stream._arrive(self.key, (ids, logprobs, finish, choice.get("stop_reason")))
                if finish is not None:
                    return
            if not self.stopping:
                raise RuntimeError("the server closed the stream before the request finished")
        except Exception as exc:  # noqa: BLE001 - handed to the sampler's step, which raises it
            if not self.stopping:
                proc = self.stream.engine.proc
                self.stream._arrive(self.key, ([], [], RuntimeError(self.stream.engine._death()) if proc is not None
                                               and proc.poll() is not None else exc, None))
        finally:
            self.conn.close()

    def stop(self) -> None:
        """Close the connection (the server aborts the request on it); `run` returns without reporting more."""
        self.stopping = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
