"""The weight channel both vLLM engines load through (`EngineWeights`), without vLLM: the checks, the buckets, the
copy of fused modules that the CPU reload path resends, the prefix-cache reset and the sync's numbers."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tandem.rollout.manifest import ManifestError

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
ATTN = "model.layers.0.self_attn."


def test_an_update_travels_by_whole_fused_modules_and_the_copy_follows_it(tiny_models):
    from tandem.rollout.vllm.weights import EngineWeights

    updates = EngineWeights(str(tiny_models["untied"]), "float32", bucket_mb=1)
    updates.attach(PACKED, on_cpu=True)  # the reload path: vLLM rebuilds a whole qkv_proj from what it is sent
    held = load_file(str(tiny_models["untied"] / "model.safetensors"))
    qkv = sorted(n for n in held if n.startswith(ATTN) and n.split(".")[-2] in PACKED["qkv_proj"])
    sent: list[list[tuple[str, torch.Tensor]]] = []
    resets: list[int] = []
    new_q = torch.full_like(held[ATTN + "q_proj.weight"], 0.5)
    stats = updates.load([(ATTN + "q_proj.weight", new_q)], sent.append, lambda: resets.append(1))
    assert [sorted(n for n, _ in bucket) for bucket in sent] == [qkv]  # q alone brings k and v along, one bucket
    assert all(torch.equal(t, new_q if n.endswith("q_proj.weight") else held[n]) for n, t in sent[0])
    assert resets == [1] and stats.buckets == 1 and stats.bytes == sum(held[n].nbytes for n in qkv)
    updates.load([(ATTN + "k_proj.weight", held[ATTN + "k_proj.weight"] * 2)], sent.append, lambda: resets.append(1))
    assert torch.equal(dict(sent[1])[ATTN + "q_proj.weight"], new_q)  # the copy holds the last update's q
    with pytest.raises(ManifestError, match="model.layers.0.nope"):  # refused before anything is sent
        updates.load([("model.layers.0.nope", new_q)], sent.append, lambda: resets.append(1))
    assert len(sent) == 2 and resets == [1, 1]


def test_buckets_hold_at_most_the_limit_and_a_gpu_engine_keeps_no_copy(tiny_models):
    from tandem.rollout.vllm.weights import EngineWeights

    updates = EngineWeights(str(tiny_models["tied"]), "float32", bucket_mb=1)
    updates.attach(PACKED, on_cpu=False)  # vLLM's own loader takes a part of a fused module
    named = list(load_file(str(tiny_models["tied"] / "model.safetensors")).items())
    sent: list[list[tuple[str, torch.Tensor]]] = []
    stats = updates.load(named, sent.append, lambda: None)
    assert sorted(n for bucket in sent for n, _ in bucket) == sorted(n for n, _ in named)  # each tensor once
    assert all(sum(t.nbytes for _, t in bucket) <= 1 << 20 or len(bucket) == 1 for bucket in sent)
    assert stats.buckets == len(sent) > 1 and stats.bytes == sum(t.nbytes for _, t in named)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineWeights(str(tiny_models["tied"]), "float64", bucket_mb=1)


def test_the_reloads_false_alarms_are_dropped_only_from_the_reloading_call_and_thread():
    """vLLM's reload warns of every module a bucket leaves out (vllm.worker.quiet_reload); those records, and only
    those, logged by the reloading thread during the call, are dropped: vLLM's other warnings, and these from another
    thread or after the call, still show."""
    import logging
    import threading

    from tandem.rollout.vllm.worker import _RELOAD_FALSE_ALARMS, quiet_reload

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    (layerwise, failed), (inplace, not_loaded) = _RELOAD_FALSE_ALARMS.items()
    root = logging.getLogger("vllm")
    root.addHandler(handler)

    def alarms() -> None:
        logging.getLogger(layerwise).warning(failed, "RMSNorm")
        logging.getLogger(inplace).warning(not_loaded, {"model.norm.weight"})
        logging.getLogger(layerwise).warning("%s: something else", "RMSNorm")

    try:
        with quiet_reload():
            alarms()
            other = threading.Thread(target=alarms)
            other.start()
            other.join()
        alarms()
    finally:
        root.removeHandler(handler)
    quiet = ["RMSNorm: something else"]
    loud = ["RMSNorm: Failed to load weights", "Following weights were not loaded from checkpoint: "
            "{'model.norm.weight'}", "RMSNorm: something else"]
    assert seen == quiet + loud + loud
    assert not logging.getLogger(layerwise).filters and not logging.getLogger(inplace).filters
