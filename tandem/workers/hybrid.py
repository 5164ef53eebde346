"""The hybrid worker: one process's trainer (policy shard, reference) and rollout engine, used in turn, the idle side
moved off the device."""
from __future__ import annotations

import time

from tandem.architectures import ModelProfile
from tandem.config import Config
from tandem.rollout import ModelPrompt, Rollout, Samples, Sampling, make_engine
from tandem.rollout.manifest import differing, digest
from tandem.sync.local import push_weights
from tandem.train.policy import GROUPS, Policy
from tandem.workers.group import WorkerContext
from tandem.workers.rollout import engine_args, sample_with
from tandem.workers.stream import StreamGroup, StreamReport, StreamSampler
from tandem.workers.train import TrainWorker

# What must be on the compute device in each phase (the rest may go to the host):
# generate: the engine; logprobs: policy params + reference + teacher; update: policy params, grads, optimizer state;
# sync: policy params (source) + engine (destination).
PHASES = {
    "generate": {"engine"},
    "logprobs": {"params", "ref", "teacher"},
    "update": {"params", "grads", "optim"},
    "sync": {"params", "engine"},
}


class HybridWorker:
    """Colocated placement: generate -> logprobs -> update -> sync weights, all in this process: a `TrainWorker`
    and a rollout engine.

    With offload on, each phase first moves what it does not need to the host (bucket by bucket) and brings to the
    device what it needs, so the peak is the largest phase, not the sum of three models. Bytes resident per phase
    are metrics (`memory/<phase>_bytes`).
    """

    def __init__(self, cfg: Config, ctx: WorkerContext | None = None, shm_ident: str = "", *,
                 model: ModelProfile | None = None):
        """`model`: the policy's profile, resolved once for the run (from the config when not given, as
        `TrainWorker`). `shm_ident`: the run's prefix for a tensor-parallel vLLM engine's shared memory (see
        placement.build).

        Every rank builds its engine here, at the same point: a vLLM engine adopts the workers' process group and
        creates its own groups over it collectively. With rollout.tensor_parallel T, workers r..r+T-1 (r a
        multiple of T) form one engine: each makes the same generate calls, and only the first reports them."""
        self.trainer = TrainWorker(cfg, ctx, model=model)
        self.cfg, self.ctx = cfg, self.trainer.ctx
        name, kwargs = engine_args(cfg, self.trainer.profile, self.ctx.device)
        self.engine_tp = cfg.rollout.tensor_parallel if self.ctx.size > 1 else 1
        self.engine_rank = self.ctx.rank % self.engine_tp
        if name == "vllm" and self.engine_tp > 1:
            kwargs["shm_ident"] = shm_ident or None
        self.engine = make_engine(name, **kwargs)
        self.sample = sample_with(cfg, self.engine)
        pl = cfg.placement
        self.offload = pl.offloads(self.ctx.device)
        self.version = 0
        self._resident: dict[str, int] = {}
        self._engine_awake = True
        self._resharder = None  # runs the engine sync's plan; made at the first sync, kept with its setup
        self._stream: StreamSampler | None = None  # placement.schedule: stream

    @property
    def policy(self) -> Policy:
        return self.trainer.policy

    def _enter(self, phase: str) -> None:
        """Make the device hold exactly what `phase` needs (when offloading); record the bytes resident."""
        if self.offload:
            need = PHASES[phase]
            if "engine" not in need and self._engine_awake:
                self.engine.sleep()
                self._engine_awake = False
            self.policy.to_host(*(g for g in GROUPS if g not in need))
            self.policy.to_device(*(g for g in GROUPS if g in need))
            if "engine" in need and not self._engine_awake:
                self.engine.wake()  # contents undefined until the sync below writes them
                self._engine_awake = True
        self._resident[phase] = sum(self.policy.residency().values()) + self._engine_bytes()

    def _engine_bytes(self) -> int:
        resident = getattr(self.engine, "resident_bytes", None)
        return int(resident()) if resident else 0

    def generate(self, prompts: list[ModelPrompt], sampling: Sampling, min_version: int = 0) -> Rollout:
        if self.version < min_version:  # calls run in submission order: the sync asked for came first
            raise RuntimeError(f"generate asked for policy version {min_version}; this engine holds {self.version}")
        self._enter("generate")
        start = time.perf_counter()
        comps = self.sample(prompts, sampling)
        end = self.trainer.finished()  # the trainer's idle time is what follows: scoring, shipping
        # an engine's TP peers sampled the same completions; its first rank reports them
        return Rollout(Samples.of_call(comps if self.engine_rank == 0 else [], len(prompts)), self.version,
                       end - start)

    def stream_add(self, groups: list[StreamGroup], sampling: Sampling) -> None:
        """placement.schedule: stream in one process: more groups to sample. They decode only inside
        `stream_take`, while the controller waits for groups: nothing overlaps the update here."""
        if self._stream is None:
            self._stream = StreamSampler(self.cfg, self.engine)
        self._stream.add(groups, sampling)

    def stream_take(self, timeout: float) -> StreamReport:
        """Decode until a group finishes or `timeout` seconds pass; the groups finished. The requests in flight
        go on under the weights synced since the last take (their prefixes prefilled again)."""
        self._enter("generate")
        stream, deadline = self._stream, time.perf_counter() + timeout
        if stream.version != self.version:
            stream.weights_changed(self.version)
        while not stream.outbox and time.perf_counter() < deadline and stream.step():
            pass
        stream.suspend()  # the engine, between takes, evaluates, loads weights and sleeps with no request of ours
        return stream.take()

    def prepare(self, samples: Samples):
        self._enter("logprobs")
        return self.trainer.prepare(samples)

    def train(self, advantages) -> dict[str, float]:
        self._enter("update")
        stats = self.trainer.train(advantages, diagnose=self._stale_parameters)
        stats.update({f"memory/{p}_bytes": float(b) for p, b in self._resident.items()})
        return stats

    def _stale_parameters(self) -> str:
        """Which parameters the engine holds differently from the trainer, by per-parameter checksums (the trainer's
        weights are still the ones synced: no optimizer step has run)."""
        try:
            theirs = self.engine.weight_digest()
        except Exception as exc:  # the diagnosis must not hide the stop itself
            return f"(The engine's checksums could not be read: {exc!r}.)"
        full = ((n, t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in self.policy.named_weights())
        ours = {name: digest(t) for name, t in self.trainer.to_engine.views(full)}  # by the engine's names
        stale = differing(ours, theirs)
        if not stale:
            return (f"Every one of the {len(ours)} parameters the engine was given matches the trainer's by checksum, "
                    "so the engine's own loading or use of them is at fault, not the transfer.")
        shown = ", ".join(stale[:10]) + (f" and {len(stale) - 10} more" if len(stale) > 10 else "")
        return (f"Parameters most likely stale (engine copy differs from the trainer's, {len(stale)} of {len(ours)}): "
                f"{shown}.")

    def sync_weights(self, version: int) -> dict:
        """Policy weights (`version` = updates so far) into this worker's engine: a copy in one process, a planned
        reshard across several."""
        self._enter("sync")
        self.version = version
        start = time.perf_counter()
        if self.trainer.mesh is None:  # by the engine's names: an MoE's experts as views of the fused tensors
            named = self.trainer.to_engine.views(self.policy.named_weights())
            return self.trainer.synced(start, push_weights(named, self.engine, self.trainer.sent_once)["bytes"])
        from tandem.sync.reshard import Resharder

        if self._resharder is None:  # the layouts never change during a run: plan once (every rank alike)
            self._resharder = Resharder(self._plan_engine_sync(), self.ctx.global_rank,
                                        bucket_bytes=self.cfg.rollout.sync_bucket_mb << 20)
        # straight into the engine's own weights where it allows that (hf); else through its load_weights
        inplace = self.engine.weights() if hasattr(self.engine, "weights") else None
        sources = self.trainer.to_engine.sources_of(dict(self.policy.named_weights()))  # the plan's names
        for bucket in self._resharder.stream(sources, out=inplace):
            self.engine.load_weights(bucket)
        return self.trainer.synced(start, self._resharder.bytes_moved)

    def _plan_engine_sync(self):
        """Trainer shards -> every engine: whole on each worker, or each engine TP rank its own slices only."""
        from tandem.rollout.manifest import check_plan
        from tandem.sync.layout import EngineTP, engine_tp_layout
        from tandem.sync.planner import plan, plan_to_replicas

        # by the engine's names and shapes (an MoE's experts one by one, their pieces in the trainer's fused shards),
        # so the check below and the planner see what the engine loads
        src = self.trainer.to_engine.layout(self.trainer.weight_layout(dict(self.policy.named_weights())))
        ranks = self.ctx.group_ranks[self.ctx.name]
        check_plan(self.engine.manifest(), {n: (tuple(p.shape), p.dtype) for n, p in src.items()},
                   f"worker {self.ctx.global_rank}'s engine", self.engine.weight_aliases())
        if self.engine_tp == 1:
            return plan_to_replicas(src, ranks)
        c = self.policy.model.config
        heads = c.num_attention_heads
        tp = EngineTP(self.engine_tp, heads, getattr(c, "num_key_value_heads", None) or heads)
        groups = [ranks[i:i + self.engine_tp] for i in range(0, len(ranks), self.engine_tp)]
        return plan(src, engine_tp_layout({n: (p.shape, p.dtype) for n, p in src.items()}, groups, tp))

    def shared_memory_segments(self) -> list[str]:
        """This worker's engine's shared-memory files, for the driver to remove after the workers are gone (a
        killed worker cannot)."""
        find = getattr(self.engine, "shared_memory_segments", None)
        return find() if find else []

    def save(self, folder: str) -> None:
        self.policy.to_device("params", "optim")  # a checkpoint reads them; the next phase moves them off again
        self.trainer.save(folder)

    def restore(self, folder: str) -> None:
        self.policy.to_device(*GROUPS)
        self.trainer.restore(folder)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.engine.close()
