"""LoRA on Ray workers: 2 colocated FSDP workers train the adapter as one process does, and a split run sends only
the adapter's bytes to its samplers, which sample with the merged policy."""
from __future__ import annotations

import functools
import json
import os
import tempfile

import pytest
import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: stay on loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
pytest.importorskip("ray")

from test_placement import BOUNDED, fixed_completions, small_config  # noqa: E402

from tandem.rollout import Samples  # noqa: E402
from tandem.trainer import train  # noqa: E402
from tandem.workers.hybrid import HybridWorker  # noqa: E402
from ray_workers import ray_session, start_group  # noqa: E402

LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2")


@pytest.fixture(scope="module")
def session():
    folder = tempfile.mkdtemp(prefix="tandem-ray-")
    with ray_session(num_cpus=4, temp_dir=folder, log_to_driver=False, object_store_memory=100 << 20):
        yield


class _LoraProbe(HybridWorker):
    def adapter(self) -> dict[str, torch.Tensor]:
        return self.policy.full_adapter()

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.engine.weights().items()}


def _steps(call, steps: int = 3) -> list[float]:
    comps, adv = fixed_completions()
    losses = []
    for _ in range(steps):
        call("prepare", Samples.of_call(comps))
        losses.append(call("train", adv)["loss"])
    return losses


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zoo_models

    return zoo_models.build(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


# fp32 sums in another order (tolerances as the full-model FSDP test: tests/workers/test_placement.py). On the MoE,
# AdamW moves an expert adapter's element whose gradient is rounding-sized (an expert few tokens reach) by up to lr
# either way: measured 3e-5 after 3 steps of lr 1e-2 under FSDP; a wrong expert's rows are off by the weights.
ADAPTER_ATOL = {"tiny_model": 2e-6, "moe_model": 1e-4}


@pytest.mark.parametrize("model", ["tiny_model", "moe_model"])
def test_lora_on_two_colocated_workers_matches_one_process(session, model, request, tmp_path):
    """The same completions and advantages, 3 updates with KL (the base as reference) and 2 mini-batches: FSDP over
    2 workers gives one process's losses and adapter; then each worker's engine holds the merged policy, equal to
    one process's merge. The MoE's stacked experts (LoRA's default there) are FSDP-sharded by expert: each rank
    merges its own experts' adapters."""
    extra = [*LORA, "algo.kl_coef=0.05", "batch.mini_batches=2", "batch.micro_batch_tokens=24",
             "rollout.max_logprob_diff=null",  # made-up sampler logprobs
             "algo.router_aux_coef=0"]  # the MoE's load-balancing loss is each rank's tokens': not sharding-exact
    path, atol = request.getfixturevalue(model), ADAPTER_ATOL[model]
    one = _LoraProbe(small_config(path, tmp_path / "one", *extra, "placement.backend=local"))
    ref_losses = _steps(lambda m, *a: getattr(one, m)(*a))
    ref_adapter = one.adapter()
    one.sync_weights(3)
    ref_engine = one.engine_weights()
    cfg = small_config(path, tmp_path / "w2", *extra, "placement.workers=2")
    group = start_group("hybrid", functools.partial(_LoraProbe, cfg), 2, **BOUNDED)
    try:
        losses = _steps(lambda m, *a: group.call(m, *a)[0])
        adapter = group.call("adapter")[0]
        group.call("sync_weights", 3)
        engines = group.call("engine_weights")
    finally:
        group.shutdown()
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    assert adapter.keys() == ref_adapter.keys()
    assert (model == "moe_model") == any(".mlp.experts." in n for n in adapter)
    for name, t in ref_adapter.items():
        torch.testing.assert_close(adapter[name], t, rtol=1e-5, atol=atol, msg=name)
    assert any(float(t.abs().max()) > 0 for n, t in adapter.items() if "lora_B" in n)
    for rank, weights in enumerate(engines):
        for name, w in ref_engine.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=atol, msg=f"rank {rank}: {name}")


def test_lora_split_sends_only_the_adapter(session, tiny_model, tmp_path):
    """1 trainer -> 1 sampler (hf engine): each step's sync carries A and B of every adapted module and nothing
    else, and the sampler, merging them into its base, samples with the trainer's logprobs."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(tiny_model))
    r, h, kv = 4, c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, c.intermediate_size), (h, c.intermediate_size),
              (c.intermediate_size, h)]  # (in, out) of q k v o gate up down, one layer
    _split_sends_the_adapter(tiny_model, tmp_path, sum(r * (i + o) for i, o in shapes) * 4)  # fp32


def test_lora_on_the_experts_split_sends_only_the_adapter(session, moe_model, tmp_path):
    """The same for the MoE with LoRA's defaults: attention, and each layer's stacked experts one adapter per
    expert (A [E*r, in], B [out, r*E]), which the sampler merges into the experts it assembled from the
    checkpoint's per-expert tensors."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(moe_model))
    r, e, h, i = 4, c.num_experts, c.hidden_size, c.moe_intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = r * ((h + q) + 2 * (h + kv) + (q + h))
    experts = r * e * ((h + 2 * i) + (i + h))  # gate_up: in h, out 2i; down: in i, out h
    _split_sends_the_adapter(moe_model, tmp_path, c.num_hidden_layers * (attention + experts) * 4)


def _split_sends_the_adapter(model, tmp_path, adapter_bytes: int) -> None:
    out = tmp_path / "run"
    train(small_config(model, out, *LORA, "placement.mode=split", "run.steps=3", "run.save_every=0",
                       "rollout.max_logprob_diff=1e-5"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert [row["sync/bytes"] for row in rows] == [adapter_bytes] * 3
    assert all(row["logprob_diff_max"] <= 1e-5 for row in rows)
