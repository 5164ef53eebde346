"""No silent wrong sync (hf engine): a bad name manifest is refused untouched; a corrupt sync stops the run by name."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared cases
from sync_guard_cases import STALE, bad_syncs, corrupt, guard_config, steps_logged  # noqa: E402

from tandem.rollout.base import Sampling  # noqa: E402
from tandem.rollout.manifest import ManifestError  # noqa: E402
from tandem.sync.local import push_weights  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [10, 11, 12]]
GREEDY = Sampling(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from tandem.rollout.hf import HFEngine

    return HFEngine(str(tiny_model))


@pytest.mark.parametrize("case", ["missing", "duplicate", "unexpected", "shape", "dtype"])
def test_mismatched_manifest_is_refused_and_the_engine_keeps_its_weights(engine, case):
    sd = {n: p.detach().clone() for n, p in engine.weights().items()}
    before = engine.generate(PROMPTS, GREEDY)
    bad, words = bad_syncs(sd)[case]
    with pytest.raises(ManifestError, match="refused before anything was written") as err:
        push_weights(bad, engine)
    assert words in str(err.value) and "hf" in str(err.value).lower()
    assert all(torch.equal(p, sd[n]) for n, p in engine.weights().items())
    after = engine.generate(PROMPTS, GREEDY)
    assert [(c.completion_ids, c.logprobs) for c in after] == [(c.completion_ids, c.logprobs) for c in before]


# on-policy (the check runs between the update's forwards and its optimizer step) and off-policy (mu = 2: it runs on
# the old-logprob pass of `prepare`, before the first update)
@pytest.mark.parametrize("extra", [(), ("algo.mu=2",)], ids=["on_policy", "mu2"])
def test_a_corrupted_sync_stops_the_run_naming_the_engine_and_the_parameter(tiny_model, tmp_path, monkeypatch, extra):
    from tandem.rollout.hf import HFEngine
    from tandem.trainer import train

    load = HFEngine.load_weights
    monkeypatch.setattr(HFEngine, "load_weights", lambda self, named: load(self, corrupt(named)))
    out = tmp_path / "run"
    with pytest.raises(Exception, match="max_logprob_diff") as err:
        train(guard_config(tiny_model, out, *extra))
    message = str(err.value)
    assert "hf engine" in message and STALE in message, message
    assert ", 1 of " in message  # only the corrupted tensor is named
    # step 1 sampled from the weights loaded from disk; step 2's samples came from the corrupted sync and
    # were never trained on: the run stopped before its update (no metrics line, no checkpoint)
    assert steps_logged(out) == [0, 1]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_the_check_can_be_turned_off_and_passes_clean_syncs(tiny_model, tmp_path, monkeypatch):
    from tandem.rollout.hf import HFEngine
    from tandem.trainer import train

    train(guard_config(tiny_model, tmp_path / "clean"))  # on by default; a clean run is never stopped
    assert steps_logged(tmp_path / "clean")[-1] == 3
    load = HFEngine.load_weights
    monkeypatch.setattr(HFEngine, "load_weights", lambda self, named: load(self, corrupt(named)))
    train(guard_config(tiny_model, tmp_path / "off", "rollout.max_logprob_diff=null"))
    rows = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["logprob_diff"] > 1e-3  # what the check would have stopped


def test_a_streamed_sync_plan_that_misses_a_parameter_is_refused_before_any_weights_move(engine):
    """Colocated reshards and split samplers load bucket by bucket: their plan is checked whole, up front."""
    from tandem.rollout.manifest import check_plan
    from tandem.sync.layout import replicated_layout
    from tandem.sync.planner import plan_to_replicas
    from tandem.workers.rollout import RolloutWorker

    specs = {n: (tuple(p.shape), p.dtype) for n, p in engine.weights().items()}
    check_plan(engine.manifest(), specs, "the hf engine")  # a whole plan passes
    dropped = sorted(specs)[-1]
    short = {n: s for n, s in specs.items() if n != dropped}
    with pytest.raises(ManifestError, match=f"1 of the engine's {len(specs)} parameters missing: '{dropped}'"):
        check_plan(engine.manifest(), short, "the hf engine")
    from tandem.config import load_config

    sampler = RolloutWorker.__new__(RolloutWorker)  # the check needs only its config, engine and rank
    sampler.cfg, sampler.engine, sampler._plan = load_config(None, []), engine, None
    sampler.ctx = type("Ctx", (), {"global_rank": 1})()
    with pytest.raises(ManifestError, match=f"sampler 1's engine.*'{dropped}'"):
        sampler.set_sync_plan(plan_to_replicas(replicated_layout(short, [0]), [1]))
    assert sampler._plan is None
    sampler.set_sync_plan(plan_to_replicas(replicated_layout(specs, [0]), [1]))
    assert sampler._plan is not None
