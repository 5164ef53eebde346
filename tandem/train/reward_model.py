"""`rewards: [{name: model, path: ...}]`: a sequence-classification reward model scoring prompt + completion, in the
trainer's process, batched by a token budget, on the device only while it scores (fine-grained offload)."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from tandem.modeling import ModelFolderError, check_model_folder, load_sequence_classifier
from tandem.modeling import load_tokenizer, read_json
from tandem.train.offload import Offloader
from tandem.util import residency

log = logging.getLogger("tandem.train.reward_model")

NAME = "model"  # the reward's name in `rewards:`
NORMALIZATIONS = ("none", "sigmoid", "zscore")  # RewardSpec.normalize's values


def check(specs: Sequence[Any]) -> None:
    """Refuse, before any model loads, a `name: model` reward whose path is not a local sequence-classification
    checkpoint with one output (config.json, weights and tokenizer read cheaply: no weights loaded)."""
    for i, spec in enumerate(specs):
        if getattr(spec, "name", None) == NAME:
            check_checkpoint(spec.path, f"rewards[{i}].path")


def check_checkpoint(path: str, field: str) -> Path:
    """`path` holds a whole sequence-classification checkpoint with one output; ValueError naming `field`."""
    if not path:
        raise ModelFolderError(f"{field}: empty; set it to a local sequence-classification checkpoint with one "
                               "output (a folder with config.json, *.safetensors and its tokenizer)")
    folder = check_model_folder(path, field)  # a folder, config.json, whole safetensors, a tokenizer
    config = read_json(folder / "config.json")
    archs = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ModelFolderError(
            f"{field}: {path!r} is not a sequence classifier (config.json architectures: {archs or 'none'}); a reward "
            "model is a *ForSequenceClassification checkpoint with one output (e.g. Skywork-Reward); a causal LM "
            "belongs in model.path")
    labels = config.get("id2label")
    outputs = len(labels) if isinstance(labels, dict) else int(config.get("num_labels", 2))
    if outputs != 1:
        raise ModelFolderError(
            f"{field}: {path!r} has {outputs} outputs (config.json {'id2label' if labels else 'num_labels'}); a "
            "reward model gives one score per text: use a checkpoint trained with num_labels=1")
    return folder


class RewardModel:
    """A batched reward `(completions, prompts, rows) -> scores` backed by a sequence classifier (one output).

    Each text is what the model was trained on: with a chat template, the prompt as the user's turn (the row's
    `_messages` where the prompt was a chat) and the completion as the assistant's, rendered by its own template;
    without one, prompt + completion followed by its tokenizer's EOS. Texts are sorted by length and packed into
    forwards of at most `batch_tokens` tokens (rows x the longest, padding on the right included). The model stays
    in host memory between calls when `offload` (the reference model's offload, `tandem.train.offload`), so it
    holds the device only while it scores. A text that cannot be scored (longer than the model's positions, a
    template that fails) fails alone: its place holds the exception, which the scorer counts as `raised` and
    scores 0; a forward that fails is retried row by row, so one bad row does not fail its batch."""

    def __init__(self, path: str, *, normalize: str = "none", batch_tokens: int = 8192, device: str = "cpu",
                 dtype: str = "float32", offload: bool = False, trust_remote_code: bool = False):
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize: {normalize!r}; choose one of {', '.join(NORMALIZATIONS)}")
        check_checkpoint(path, "path")
        self.normalize, self.batch_tokens, self.offload = normalize, int(batch_tokens), offload
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(path, trust_remote_code)
        self.model = load_sequence_classifier(path, dtype, trust_remote_code).eval().requires_grad_(False)
        self.model.to(self.device)
        # without a pad token a classifier cannot find each row's last token in a padded batch: one row a forward
        self.pad_id = self.model.config.pad_token_id
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.template = bool(getattr(self.tokenizer, "chat_template", None))
        weights = lambda: list(self.model.parameters()) + list(self.model.buffers())  # noqa: E731
        for t in weights():
            residency.ensure_resizable(t)  # offload frees storages in place; a memory-mapped one cannot be
        self.offloader = Offloader(self.device)
        self.offloader.register("weights", weights)
        self.weight_bytes = sum(self.offloader.resident_bytes().values())
        if offload:
            self.offloader.to_host("weights")
        self._last: dict[str, float] = {}

    def encode(self, completion: str, prompt: str, row: Mapping) -> list[int]:
        """The token ids the model scores for one sample (see the class docstring)."""
        tok = self.tokenizer
        if self.template:
            turns = list(row.get("_messages") or [{"role": "user", "content": prompt}])
            text = tok.apply_chat_template(turns + [{"role": "assistant", "content": completion}], tokenize=False)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(prompt + completion, add_special_tokens=False)
            ids += [tok.eos_token_id] if tok.eos_token_id is not None else []
        if not ids:
            raise ValueError("the text to score is empty")
        if self.max_positions and len(ids) > self.max_positions:
            raise ValueError(f"{len(ids)} tokens, over the reward model's {self.max_positions} positions")
        return ids

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices packed into forwards: longest first, each at most `batch_tokens` padded tokens (one row always
        goes, however long); one row a forward where the model has no pad token."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out: list[list[int]] = []
        for i in order:
            if out and self.pad_id is not None and (len(out[-1]) + 1) * lengths[out[-1][0]] <= self.batch_tokens:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    @torch.no_grad()
    def forward(self, seqs: list[list[int]]) -> list[float]:
        """The model's one output for each sequence, in one forward, padded on the right."""
        width = max(map(len, seqs))
        pad = self.pad_id if self.pad_id is not None else 0
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=self.device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=self.device)
        return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()

    def __call__(self, completions: list[str], prompts: list[str], rows: list[Mapping]) -> list[Any]:
        start = time.perf_counter()
        out: list[Any] = [None] * len(completions)
        seqs: dict[int, list[int]] = {}
        for i, (c, p, r) in enumerate(zip(completions, prompts, rows)):
            try:
                seqs[i] = self.encode(c, p, r)
            except Exception as exc:  # that sample fails alone (the scorer counts it); the others are scored
                out[i] = exc
        keys = list(seqs)
        groups = [[keys[j] for j in b] for b in self.batches([len(seqs[k]) for k in keys])] if keys else []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.offloader.to_device("weights")
        resident = sum(self.offloader.resident_bytes().values())
        loaded = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        try:
            for group in groups:
                try:
                    scores = self.forward([seqs[i] for i in group])
                except Exception:  # find the row that fails: the others keep their scores
                    scores = [self._one(seqs[i]) for i in group]
                for i, s in zip(group, scores):
                    out[i] = s
        finally:
            if self.offload:
                self.offloader.to_host("weights")
        raw = [s for s in out if isinstance(s, float)]
        self._last = self._stats(groups, seqs, raw, resident, loaded, time.perf_counter() - start)
        return normalized(out, self.normalize)

    def _one(self, seq: list[int]) -> Any:
        try:
            return self.forward([seq])[0]
        except Exception as exc:
            return exc

    def _stats(self, groups: list[list[int]], seqs: dict[int, list[int]], raw: list[float], resident: int,
               loaded: int, seconds: float) -> dict[str, float]:
        padded = [len(g) * max(len(seqs[i]) for i in g) for g in groups]
        scores = torch.tensor(raw, dtype=torch.float64)
        stats = {"seconds": seconds, "batches": float(len(groups)),
                 "batch_rows": len(seqs) / len(groups) if groups else 0.0,
                 "batch_tokens": float(max(padded, default=0)),
                 "raw_mean": float(scores.mean()) if len(raw) else 0.0,
                 "raw_std": float(scores.std()) if len(raw) > 1 else 0.0,
                 "resident_bytes": float(resident),
                 "idle_bytes": float(sum(self.offloader.resident_bytes().values()))}
        if self.device.type == "cuda":
            stats["peak_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
            stats["activation_bytes"] = stats["peak_bytes"] - loaded  # above what was allocated, its weights in
        return stats

    def metrics(self, key: str) -> dict[str, float]:
        """The last call's figures under the reward's metric name `key` (tandem.run.metric_names, "Reward model")."""
        m = self._last
        out = {f"time/reward_model/{key}": m.get("seconds", 0.0)}
        out.update({f"reward_model/{key}/{k}": m[k] for k in ("batches", "batch_rows", "batch_tokens", "raw_mean",
                                                               "raw_std") if k in m})
        memory = ("resident_bytes", "idle_bytes", "peak_bytes", "activation_bytes")
        out.update({f"memory/reward_model/{key}/{k}": m[k] for k in memory if k in m})
        return out

    def close(self) -> None:
        """Free the model (the scorer calls it when the run ends)."""
        self.model = None
        self.offloader.groups.clear()


def normalized(out: list[Any], rule: str) -> list[Any]:
    """A call's scores under `rule` (NORMALIZATIONS; `zscore` over the call's scores); failed places (exceptions)
    stay as they are."""
    if rule == "sigmoid":
        return [1 / (1 + math.exp(-s)) if isinstance(s, float) else s for s in out]
    if rule == "zscore":
        ok = torch.tensor([s for s in out if isinstance(s, float)], dtype=torch.float64)
        if len(ok) < 2:
            return [0.0 if isinstance(s, float) else s for s in out]
        mean, std = float(ok.mean()), float(ok.std())
        return [((s - mean) / std if std > 0 else 0.0) if isinstance(s, float) else s for s in out]
    return out


def builder(device: str, dtype: str, offload: bool, trust_remote_code: bool = False):
    """What the trainer gives `RewardScorer(builders={"model": ...})`: a config RewardSpec -> its RewardModel."""
    def build(spec: Any) -> RewardModel:
        return RewardModel(spec.path, normalize=spec.normalize, batch_tokens=spec.batch_tokens, device=device,
                           dtype=dtype, offload=offload, trust_remote_code=trust_remote_code)

    return build
