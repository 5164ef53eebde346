"""Cases shared by the sync-guard tests of both engines: bad syncs, a corrupted tensor, a tiny run's config."""
from __future__ import annotations

import json

import torch

STALE = "model.layers.0.mlp.down_proj.weight"  # the tensor a test corrupts


def bad_syncs(sd: dict[str, torch.Tensor]) -> dict[str, tuple[list, str]]:
    """Whole syncs that must be refused, each with the words its error must hold."""
    names = list(sd)
    new = {n: t + 0.1 for n, t in sd.items()}  # would change every output, were any of it written
    items = list(new.items())
    return {
        "missing": ([i for i in items if i[0] != STALE], f"missing: {STALE!r}"),
        "duplicate": (items + [(names[0], new[names[0]])], "given twice"),
        "unexpected": (items + [("model.layers.7.mlp.up_proj.weight", new[names[1]])], "unknown parameter"),
        "shape": ([(n, t[:1] if n == STALE else t) for n, t in items], "has shape"),
        "dtype": ([(n, t.double() if n == STALE else t) for n, t in items], "torch.float64, expected torch.float32"),
    }


def guard_config(model, out, *extra: str):
    from tandem.config import load_config

    return load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=3", "run.save_every=0", "run.progress=false",
        "run.report_to=[]", "run.plots=false", "batch.prompts_per_step=4", "batch.group_size=4",
        "rollout.max_new_tokens=6", "data.max_prompt_tokens=8", "batch.micro_batch_tokens=64", "optim.lr=1e-3",
        "data.eval_size=4", "reward_pool.workers=0", *extra,
    ])


def corrupt(tensors, name: str = STALE):
    """One tensor of a sync bucket damaged on its way: noise of its own std (as a wrong or torn copy would be)."""
    g = torch.Generator().manual_seed(0)
    return [(n, t + t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype) if n == name else t)
            for n, t in tensors]


def steps_logged(out) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []
