"""The config's `placement` section: where the workers run (one process, colocated or split, local or Ray), their
parallelism and resources, and the schedule that interleaves sampling and training."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import ConfigError, Section


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
        "FSDP2 data parallel, so workers (or train_workers) = dp x tensor_parallel (x context_parallel).",
    )
    context_parallel: int = Field(
        1, ge=1, description="Training context-parallel degree (Ulysses): each micro-batch's packed sequence is "
        "split into this many contiguous chunks, one per training worker of a group; each worker runs its chunk, "
        "and attention exchanges sequence for heads by all-to-all so every head attends over the whole sequence "
        "(each row to itself, causally). Long rows then fit where one worker's activations would not. Workers (or "
        "train_workers) = dp x context_parallel x tensor_parallel; FSDP2 shards over dp x context_parallel. Needs "
        "batch.padding_free: true, and the model's attention heads per tensor-parallel rank divisible by it (KV "
        "heads that are not are copied to each rank's query heads: more traffic, same result). Dense models with "
        "full or sliding-window softmax attention only: mixtures of experts, linear attention (Qwen3.5), "
        "vision-language models and LoRA are refused with it. 1 = off.",
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
    rollout_workers: int = Field(
        1, ge=1, description="split: sampler instances (data parallel; prompts are balanced by expected tokens).",
    )
    schedule: Literal["sync", "async", "stream"] = Field(
        "sync", description="`sync`: sample, then train, each step. `async` (split only): the samplers generate the "
        "next batches while the trainers train, at most `max_staleness` policy versions behind; the loss corrects "
        "for it with the sampler's logprobs: they are the clipped ratio's old policy, or with algo.tis_cap (or "
        "algo.is_mask) the trainer recomputes that one and the importance weight pi_old / pi_sampler corrects the "
        "staleness. `stream` (split, or one process; vLLM in process or a server, or the hf engine on the model zoo's "
        "architectures without sliding-window layers): each sampler keeps rollout.max_in_flight requests decoding "
        "and starts new ones as others stop, across step boundaries; a step trains as soon as "
        "batch.prompts_per_step groups have finished (scored as they arrive), new weights land between decode steps "
        "(rollout.in_flight_weights) and the staleness bound holds per token (rollout.partial). The same loss "
        "correction as async. In one process the stream decodes only while the step waits for groups: it carries "
        "requests across updates but overlaps nothing.",
    )
    max_staleness: int = Field(
        1, ge=1, description="async: how many batches the samplers work ahead of the one being trained, and so the "
        "most policy versions a trained batch lags the trainer (the schedule never goes further; a batch older than "
        "this would stop the run with an error, never be trained on). stream: the most versions any trained token "
        "lags the trainer (see rollout.partial), and groups are started at most (max_staleness + 1) steps' worth "
        "ahead.",
    )
    offload: bool | Literal["auto"] = Field(
        "auto", description="Colocated workers move the idle side off the compute device bucket by bucket: policy "
        "params/grads/optimizer, reference and distillation teacher while sampling, the engine while training. "
        "`auto`: on for GPUs, off on CPU (there host and device are the same memory; `true` still runs it, for tests "
        "and accounting).",
    )
    reward_workers: int = Field(
        0, ge=0, description="Ray backend: each model-backed reward (`name: model`, `name: judge`) runs on this many "
        "Ray workers of its own (with cpus_per_worker and gpus_per_worker each; a call's samples shared out over "
        "them), instead of in the controller's process. 0 = in the controller, on its device (offloaded between "
        "scorings with `offload`). A judge on a vLLM server starts its server from its worker.",
    )
    teacher_workers: int = Field(
        0, ge=0, description="Ray backend, with algo.distill: the teacher runs on this many Ray workers of its own "
        "(a step's groups shared out over them), scoring each batch while the trainers update on the previous one, "
        "instead of beside the policy in every training worker. 0 = beside the policy, sharded as the reference "
        "is and offloaded outside the logprobs phase.",
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

    def offloads(self, device: str) -> bool:
        """Whether a worker on `device` moves what its phase does not need off the device (`offload`)."""
        return self.offload is True or (self.offload == "auto" and device != "cpu")

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
