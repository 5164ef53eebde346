"""The trainer role: the policy (and reference) shard of one process, its share of each batch, checkpoints."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from tandem.config import Config
from tandem.architectures import ModelProfile, profile
from tandem.modeling import load_processor, load_tokenizer
from tandem.rollout import Samples
from tandem.sync.convert import ToCheckpoint
from tandem.sync.frozen import SentOnce, engine_keeps_weights
from tandem.train.batch import MicroBatch, make_micro_batches
from tandem.train.policy import Policy, PreparedStep
from tandem.workers.balance import balance
from tandem.workers.group import WorkerContext


class SamplerMismatch(RuntimeError):
    """The sampler's logprobs disagree with the trainer's beyond rollout.max_logprob_diff (a bad weight sync; with
    images in the prompts, possibly other pixels or image tokens)."""


def _images_note(names: tuple[str, ...]) -> str:
    """What a sampler mismatch says of the step's prompt images (none: nothing): the weights may be right and the
    pictures not, which no weight sync fixes."""
    if not names:
        return ""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"The prompts hold images ({shown}): the sampler may have seen other pixels or image tokens than the "
            "trainer (an image decoded or resized otherwise: data.max_pixels and data.min_pixels must reach both "
            "alike), so the weights may not be at fault. ")


class TrainWorker:
    """One training process. With several, they form a (dp, cp, tp) mesh: FSDP2 over dp (x cp), context parallel
    over cp (each micro-batch's sequence split: `tandem.train.context_parallel`), tensor parallel over tp.

    Every worker receives the whole step's completions and takes its data-parallel share of each mini-batch
    (balanced by tokens); the loss normalizers count the whole mini-batch, so the update equals the
    single-process one (the policy sums them over dp).
    """

    def __init__(self, cfg: Config, ctx: WorkerContext | None = None, *, model: ModelProfile | None = None):
        """`model`: the policy's profile, resolved once for the run (`tandem.run.preflight`); a worker built alone
        (a test's) resolves it from the config."""
        self.cfg, self.ctx = cfg, ctx or WorkerContext()
        m, tp, cp = cfg.model, cfg.placement.tensor_parallel, cfg.placement.context_parallel
        self.profile = model or profile(cfg.model.path)
        self.tokenizer = load_tokenizer(m.path, m.trust_remote_code)
        # what a checkpoint holds beside the weights: a vision-language model's processor (its image processor and
        # tokenizer), else the tokenizer
        self.processor = load_processor(m.path, m.trust_remote_code) if self.profile.images else self.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        self.mesh = None
        self.dp_rank, self.dp_size = 0, 1
        if self.ctx.size > 1:
            from tandem.train.parallel import build_mesh

            # ranks run tp fastest, then cp: the cp x tp ranks of a dp rank take the same rows
            self.dp_size = self.ctx.size // (cp * tp)
            self.dp_rank = self.ctx.rank // (cp * tp)
            self.mesh = build_mesh(self.ctx.group_ranks[self.ctx.name], self.dp_size, tp, self.ctx.device, cp=cp)
        total_opt_steps = cfg.run.steps * cfg.algo.mu * cfg.batch.mini_batches
        torch.manual_seed(cfg.run.seed)
        self.policy = Policy(m.path, m.dtype, m.trust_remote_code, cfg.algo, cfg.optim, total_opt_steps,
                             cfg.rollout.temperature, cfg.max_completion_tokens, mesh=self.mesh,
                             device=None if self.ctx.device == "cpu" else self.ctx.device,
                             old_logprobs=cfg.old_logprobs, lora=cfg.lora, seed=cfg.run.seed,
                             expert_parallel=cfg.placement.expert_parallel,
                             teacher_on_workers=cfg.placement.teacher_workers > 0,
                             freeze_vision=cfg.model.freeze_vision, model_profile=self.profile,
                             padding_free=cfg.batch.padding_free)
        # What the engines load: vLLM (in process or a server) takes the checkpoint's tensors by the checkpoint's
        # names (an MoE's experts one by one, cut from the trainer's fused ones); the hf engine is the trainer's own
        # transformers class and takes its names as they are.
        self.to_engine = ToCheckpoint.of_model(self.policy.model, self.policy.named_weights()) \
            if cfg.rollout.engine == "vllm" else ToCheckpoint()
        # Weights the trainer never changes (a frozen vision tower) go to an engine once, if it keeps them: every sync
        # leaves them out after the first (one process: `sent_once`; planned syncs: marked in `weight_layout`).
        self.unchanging = self.policy.frozen if engine_keeps_weights(cfg, self.ctx.device) else frozenset()
        self.sent_once = SentOnce(self.to_engine.sources_of(dict.fromkeys(self.unchanging)))  # the engine's names
        self._step: PreparedStep | None = None  # prepared, not yet trained on
        self._images: tuple[str, ...] = ()  # the prepared step's prompts' images, by name (a mismatch names them)
        self._idle_since = time.perf_counter()  # see `finished`

    def finished(self) -> float:
        """This worker's work for now is done (a weight sync; a colocated worker's generation, which follows the
        sync): `time/trainer_idle` is the time from here until the next step's batch arrives. Returns now."""
        self._idle_since = time.perf_counter()
        return self._idle_since

    def prepare(self, samples: Samples) -> torch.Tensor | None:
        """Lay this worker's share of the step out for training and score old/reference logprobs. Returns each row's
        KL penalty ([N]) when `algo.kl_in_reward` is on, else None."""
        start = time.perf_counter()
        self._images = tuple(dict.fromkeys(n for c in samples.completions if c.images is not None
                                           for n in c.images.names))
        step = self.policy.prepare(self._lay_out(samples), len(samples))
        step.times.update({"time/trainer_idle": start - self._idle_since, "time/logprobs": time.perf_counter() - start})
        self._step = step
        return step.penalties

    def _lay_out(self, samples: Samples) -> list[list[MicroBatch]]:
        """The step split by group into mini-batches (one optimizer step each), each mini-batch's rows shared out
        over the dp ranks (balanced by tokens), each share packed into micro-batches by token budget. Every rank
        holds the same number of mini-batches (an empty one is fine)."""
        b = self.cfg.batch
        per = -(-samples.num_groups // b.mini_batches)
        lengths = samples.sequence_lengths
        minis = []
        for j in range(b.mini_batches):
            rows = torch.nonzero((samples.group >= j * per) & (samples.group < (j + 1) * per)).flatten().tolist()
            if not rows:
                continue
            mine = [rows[k] for k in balance([lengths[i] for i in rows], self.dp_size)[self.dp_rank]]
            minis.append(make_micro_batches(samples, b.micro_batch_tokens, self.pad_id, mine,
                                            by_prompt=self.policy.share_prompts,
                                            packed=self.policy.padding_free) if mine else [])
        return minis

    def train(self, advantages: torch.Tensor, diagnose: Callable[[], str] | None = None) -> dict[str, float]:
        """Update the policy on the prepared step with these advantages, one per row of its samples. `diagnose`:
        what a stop for a sampler mismatch should say of the engine's weights (a colocated worker compares its
        own engine's; split trainers have none to compare)."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("train was called with no prepared step: call prepare with the step's samples first")
        start = time.perf_counter()
        check = None
        if self.cfg.placement.schedule == "sync":  # stale samples drift anyway
            check = lambda mean, worst: self._check_sampler(mean, worst, diagnose)  # noqa: E731
        stats = self.policy.update(step, advantages, check_sampler=check)
        stats["time/update"] = time.perf_counter() - start
        stats.update(step.times)
        return stats

    def _check_sampler(self, mean: float, worst: float, diagnose: Callable[[], str] | None) -> None:
        """Stop a step whose samples the trainer would not have drawn (rollout.max_logprob_diff), naming the
        engine and the parameters whose engine copy is not the trainer's. Every rank sees the same numbers."""
        bound = self.cfg.rollout.logprob_diff_bound(self.cfg.model.dtype)
        if bound is None or mean <= bound:
            return
        r = self.cfg.rollout
        engine = "hf" if r.engine == "hf" else f"vllm ({r.vllm.mode})"
        which = diagnose() if diagnose is not None else (
            "The engines are on the sampler workers (split placement), so their weights cannot be compared from here.")
        raise SamplerMismatch(
            f"the sampler's logprobs differ from the trainer's by {mean:.3g} per token (max {worst:.3g}), over "
            f"rollout.max_logprob_diff={bound:g}: the {engine} engine is not sampling with the trainer's weights, "
            f"so this step was stopped before training on its samples. {which} {_images_note(self._images)}A bad "
            "weight sync is the usual cause; if the difference is expected (a numerics change), raise "
            "rollout.max_logprob_diff, or set it to null to turn the check off.")

    # -- weights out: split placement sends to the samplers --------------------------------------------------

    def local_weights(self) -> dict:
        """This rank's piece of every tensor a sampler receives (a DTensor's local shard is read by the executor):
        with LoRA only the adapter's, since the samplers hold the base weights from the start."""
        if self.policy.lora is not None:
            return self.policy.adapter_weights()
        return dict(self.policy.named_weights())

    def weight_layout(self, named: dict | None = None):
        """This group's training layout, in global ranks, of `named` (default: what the samplers receive): where
        each byte lives now."""
        from tandem.sync.layout import layout_from_dtensors, mark_unchanging, replicated_layout

        named = self.local_weights() if named is None else named
        if self.mesh is None:
            layout = replicated_layout({n: (tuple(t.shape), t.dtype) for n, t in named.items()}, [self.ctx.global_rank])
        else:
            layout = layout_from_dtensors(named, row_orders=self.policy.tp.row_orders)  # fused weights: by parts
        return mark_unchanging(layout, self.unchanging)

    def sampler_layout(self):
        """`weight_layout` of what the samplers receive, by the samplers' engine's names and shapes: the layout the
        trainers -> samplers plan is made from, and checked against each sampler's engine."""
        return self.to_engine.layout(self.weight_layout())

    def set_sync_plan(self, plan) -> None:
        """The trainers -> samplers plan, run over the weight channel (opened first) at every send."""
        from tandem.sync.reshard import Resharder

        self._resharder = Resharder(plan, self.ctx.global_rank, bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20,
                                    channel=self._channel)

    def open_weight_channel(self, address: tuple[str, int], size: int) -> None:
        """Join the trainers -> samplers weight channel (rank = global rank; global rank 0 hosts its store)."""
        from tandem.sync.channel import WeightChannel

        self._channel = WeightChannel(address, self.ctx.global_rank, size, self.cfg.placement.sync_timeout_s,
                                      self.ctx.device)

    def send_weights(self, version: int) -> dict:
        start = time.perf_counter()
        if self.ctx.global_rank == 0:
            self._channel.announce(version, sorted(self._resharder.plan.dst_shapes))
        self._resharder.run(self.to_engine.sources_of(self.local_weights()))  # the plan's names: see sampler_layout
        return self.synced(start, self._resharder.bytes_moved)

    def close(self) -> None:
        channel = getattr(self, "_channel", None)
        if channel is not None:
            channel.close()

    def synced(self, start: float, nbytes: int) -> dict:
        """A weight sync's stats; it ends the step on this worker. `finished_at` is wall-clock time: the controller
        measures steps between these, so that queued steps count once."""
        return {"seconds": self.finished() - start, "bytes": nbytes, "finished_at": time.time()}

    # -- checkpoints ------------------------------------------------------------------------------------------

    def save(self, folder: str) -> None:
        """Rank 0 writes the policy in Hugging Face format (loadable as is; with LoRA the adapter in PEFT's format,
        `tandem export` merges it) and the tokenizer; every rank writes its optimizer/schedule shard."""
        if self.policy.lora is not None:
            from tandem.train.lora import save_adapter

            adapter = self.policy.full_adapter()
            if self.ctx.rank == 0:
                save_adapter(self.policy.lora, adapter, folder)
        else:
            full = self.policy.full_state_dict()
            if self.ctx.rank == 0:
                self.policy.model.save_pretrained(folder, state_dict=full, safe_serialization=True)
        if self.ctx.rank == 0:
            self.processor.save_pretrained(folder)
        torch.save(self.policy.state_dict(), Path(folder) / self._optimizer_file())

    def restore(self, folder: str) -> None:
        """The policy and this worker's optimizer state as checkpoint `folder` holds them (a resume)."""
        if self.policy.lora is not None:
            from tandem.train.lora import read_adapter

            self.policy.load_adapter(read_adapter(folder, self.policy.model))
        else:
            weights = {}
            for shard in sorted(Path(folder).glob("*.safetensors")):
                weights.update(load_file(str(shard)))
            self.policy.load_full_state_dict(weights)
        path = Path(folder) / self._optimizer_file()
        if not path.is_file():
            found = sorted(p.name for p in Path(folder).glob("optimizer*.pt"))
            raise ValueError(f"checkpoint {folder}: no {path.name} for this worker; it holds {found} — resume with "
                             "the same number of training workers, tensor_parallel and context_parallel it was saved "
                             "with")
        self.policy.load_state_dict(torch.load(path, weights_only=False))

    def _optimizer_file(self) -> str:
        return "optimizer.pt" if self.ctx.size == 1 else f"optimizer-rank{self.ctx.rank}-of-{self.ctx.size}.pt"
