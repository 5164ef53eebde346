"""The hybrid worker: one process's policy, reference and rollout engine, used in turn (generate, train, sync)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tandem.algo import truncation_mask
from tandem.config import Config
from tandem.modeling import load_tokenizer
from tandem.rollout import Completion, Sampling, make_engine
from tandem.sync.local import push_weights
from tandem.train.batch import make_micro_batches
from tandem.train.policy import Policy
from tandem.workers.group import WorkerContext


def engine_args(cfg: Config) -> tuple[str, dict]:
    """The engine's name and constructor arguments from the config."""
    m, r = cfg.model, cfg.rollout
    if r.engine == "hf":
        return "hf", dict(model_path=m.path, dtype=m.dtype, seed=cfg.run.seed, trust_remote_code=m.trust_remote_code)
    v = r.vllm
    kwargs = dict(model_path=m.path, dtype=m.dtype, seed=cfg.run.seed, max_model_len=v.max_model_len or None,
                  kv_cache_bytes=v.kv_cache_mb << 20, gpu_memory_utilization=v.gpu_memory_utilization,
                  sync_bucket_mb=r.sync_bucket_mb, enable_sleep=v.enable_sleep,
                  enable_prefix_caching=v.enable_prefix_caching, tensor_parallel_size=v.tensor_parallel_size)
    if v.mode == "server":
        return "vllm_server", dict(kwargs, base_url=v.base_url or None, python=v.python or sys.executable)
    rows = cfg.batch.prompts_per_step * cfg.batch.group_size
    return "vllm", dict(kwargs, sleep_level=v.sleep_level, max_num_seqs=v.max_num_seqs or rows,
                        max_num_batched_tokens=v.max_num_batched_tokens or None)


class HybridWorker:
    def __init__(self, cfg: Config, ctx: WorkerContext | None = None):
        self.cfg, self.ctx = cfg, ctx or WorkerContext()
        m = cfg.model
        self.tokenizer = load_tokenizer(m.path, m.trust_remote_code)
        total_opt_steps = cfg.run.steps * cfg.algo.mu * cfg.batch.mini_batches
        torch.manual_seed(cfg.run.seed)
        self.policy = Policy(m.path, m.dtype, m.trust_remote_code, cfg.algo, cfg.optim, total_opt_steps,
                             cfg.rollout.temperature, cfg.rollout.max_new_tokens)
        name, kwargs = engine_args(cfg)
        self.engine = make_engine(name, **kwargs)
        self.pad_id = self.tokenizer.pad_token_id

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        return self.engine.generate(prompts, sampling)

    def prepare(self, completions: list[Completion]) -> list[float]:
        """Lay the step's completions out for training and score old/reference logprobs.

        The batch is split by prompt group into mini-batches (one optimizer step each), each packed into
        micro-batches by token budget. Returns each completion's KL penalty when `algo.kl_in_reward` is on.
        """
        b, a = self.cfg.batch, self.cfg.algo
        groups = sorted({c.prompt_index for c in completions})
        per = -(-len(groups) // b.mini_batches)
        zeros = torch.zeros(len(completions))
        self._mini = []
        for j in range(b.mini_batches):
            keep = set(groups[j * per:(j + 1) * per])
            subset = [i for i, c in enumerate(completions) if c.prompt_index in keep]
            if subset:
                self._mini.append(make_micro_batches(completions, zeros, b.micro_batch_tokens, self.pad_id, subset))
        if a.mask_truncated:
            keep_rows = truncation_mask(torch.tensor([c.truncated for c in completions]))
            for mb in (mb for mbs in self._mini for mb in mbs):
                mb.mask = mb.mask * keep_rows[mb.rows].unsqueeze(-1)
        start = time.perf_counter()
        self._sums, penalties = self.policy.prepare(self._mini)
        self._t_logprobs = time.perf_counter() - start
        return penalties

    def train(self, advantages: torch.Tensor) -> dict[str, float]:
        """Update the policy on the prepared batch with these per-completion advantages."""
        for mb in (mb for mbs in self._mini for mb in mbs):
            mb.advantages = advantages[mb.rows].float()
        start = time.perf_counter()
        stats = self.policy.update(self._mini, self._sums)
        stats["time/update"] = time.perf_counter() - start
        stats["time/logprobs"] = self._t_logprobs
        self._mini = []
        return stats

    def sync_weights(self) -> dict:
        return push_weights(self.policy.named_weights(), self.engine)

    def save(self, folder: str) -> None:
        """The policy in Hugging Face format (loadable as is), the tokenizer, and the optimizer/schedule state."""
        self.policy.model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        torch.save(self.policy.state_dict(), Path(folder) / "optimizer.pt")

    def load(self, folder: str) -> None:
        weights = {}
        for shard in sorted(Path(folder).glob("*.safetensors")):
            weights.update(load_file(str(shard)))
        missing, unexpected = self.policy.model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k not in self._tied_names()]:
            raise ValueError(f"checkpoint {folder}: missing {missing}, unexpected {unexpected}")
        self.policy.load_state_dict(torch.load(Path(folder) / "optimizer.pt", weights_only=False))
        self.sync_weights()

    def _tied_names(self) -> set[str]:
        named = dict(self.policy.model.named_parameters(remove_duplicate=False))
        first = {}
        tied = set()
        for n, p in named.items():
            if id(p) in first:
                tied.add(n)
            first.setdefault(id(p), n)
        return tied

    def close(self) -> None:
        self.engine.close()
