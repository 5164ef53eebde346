"""On-policy distillation (algo.distill): the teacher's logprobs of the sampled tokens, the per-token reverse KL and
the advantage it adds, against a float64 reference; the teacher refused before loading when it cannot serve."""
from __future__ import annotations

import pytest
import torch

from tandem.config import AlgoConfig, OptimConfig
from tandem.config.algo import DistillConfig
from tandem.rollout.base import Completion, Samples
from tandem.train.batch import make_micro_batches
from tandem.train.logprobs import token_logprobs
from tandem.train.policy import Policy

TEMPERATURE = 0.7  # not 1: the teacher's logprobs must be taken at the sampling temperature, as the policy's are


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from conftest import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)  # the demo's tokenizer, other weights


def _samples() -> Samples:
    g = torch.Generator().manual_seed(0)
    outs = [torch.randint(5, 200, (2 + i % 4,), generator=g).tolist() for i in range(8)]
    return Samples.of_call([Completion(torch.randint(5, 200, (3 + i % 3,), generator=g).tolist(), out,
                                       [0.0] * len(out), "", "stop", i // 4) for i, out in enumerate(outs)])


def _batch(policy: Policy, samples: Samples):
    """One mini-batch; the sampler's logprobs are the policy's own (on-policy)."""
    mbs = make_micro_batches(samples, 4096, 0)
    with torch.no_grad():
        for mb in mbs:
            mb.sampler_logprobs = token_logprobs(policy.model, mb, TEMPERATURE)[0] * mb.mask
    return [mbs]


def _float64_logprobs(path, samples: Samples) -> list[torch.Tensor]:
    """Each completion's token logprobs at TEMPERATURE from a float64 copy of the model: one row at a time, no
    padding, the plain causal-LM forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for c in samples.completions:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            logits = model(ids).logits[0, len(c.prompt_ids) - 1:-1] / TEMPERATURE
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.completion_ids)[:, None])[:, 0])
    return out


def test_the_teachers_logprobs_reverse_kl_and_advantage_match_float64(tiny_model, teacher):
    """The teacher's logprob of every sampled token and the step's `distill/reverse_kl` (the mean over tokens of
    log pi - log pi_teacher) equal a float64 computation; with no task reward, the loss of an on-policy step (ratio
    1) is -mean(advantage) = coef x reverse KL, so the advantage added is coef x (log pi_teacher - log pi), its sign
    and its weight. Red if the teacher scored at another temperature, coef were ignored, or the sign flipped."""
    coef = 0.5
    algo = AlgoConfig(distill=DistillConfig(teacher=str(teacher), coef=coef))
    policy = Policy(str(tiny_model), "float32", False, algo, OptimConfig(lr=1e-3), 10, TEMPERATURE, 5)
    samples = _samples()
    prepared = policy.prepare(_batch(policy, samples), len(samples))
    theirs, ours = _float64_logprobs(teacher, samples), _float64_logprobs(tiny_model, samples)
    for mb in prepared.mini_batches[0]:
        for i, row in enumerate(mb.rows):
            n = len(samples.completions[row].completion_ids)
            assert mb.mask[i, -n:].all() and not mb.mask[i, :-n].any()
            assert (mb.teacher_logprobs[i, -n:].double() - theirs[row]).abs().max() < 1e-5
    per_token = torch.cat([o - t for o, t in zip(ours, theirs)])
    kl = per_token.mean().item()
    stats = policy.update(prepared, torch.zeros(len(samples)))
    assert stats["distill/reverse_kl"] == pytest.approx(kl, abs=1e-5)
    assert stats["loss"] == pytest.approx(coef * kl, abs=1e-5)
    assert per_token.abs().mean() > 0.05  # the two models differ: the checks above compare something
    assert prepared.times["time/teacher"] > 0


def test_distillation_moves_the_policy_toward_the_teacher_on_its_samples(tiny_model, teacher):
    """Updates with the teacher's term alone bring the policy's logprobs of its sampled tokens toward the
    teacher's; the same updates with the sign flipped would push them apart. The teacher is offloaded between
    them (as a colocated worker does outside its logprobs phase) and scores the same when it is back."""
    algo = AlgoConfig(distill=DistillConfig(teacher=str(teacher)))
    policy = Policy(str(tiny_model), "float32", False, algo, OptimConfig(lr=3e-3), 10, TEMPERATURE, 5)
    samples = _samples()

    def gap() -> tuple[float, torch.Tensor]:
        prepared = policy.prepare(_batch(policy, samples), len(samples))
        mb = prepared.mini_batches[0][0]
        own = token_logprobs(policy.model, mb, TEMPERATURE)[0].detach()
        return float(((own - mb.teacher_logprobs).abs() * mb.mask).sum() / mb.mask.sum()), mb.teacher_logprobs

    before, teacher_before = gap()
    for _ in range(8):
        policy.update(policy.prepare(_batch(policy, samples), len(samples)), torch.zeros(len(samples)))
    assert policy.to_host("teacher") > 0 and policy.residency()["teacher"] == 0
    policy.to_device("teacher")
    after, teacher_after = gap()
    assert torch.equal(teacher_before, teacher_after)
    assert after < 0.7 * before, (before, after)


def test_a_teacher_that_cannot_serve_is_refused_before_any_model_loads(tiny_model, tmp_path, monkeypatch):
    """Another tokenizer (its logprobs would be of other tokens) and a folder that is no model: each refused naming
    algo.distill.teacher, with no model loaded."""
    from tiny_qwen import build_model

    from tandem import modeling
    from tandem.config import load_config
    from tandem.modeling import ModelFolderError
    from tandem.run.preflight import check_before_loading

    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    other = build_model(tmp_path / "other", tied=True)  # tests/tiny_qwen.py's own BPE tokenizer, 384 tokens
    for teacher, says in ((other, "has another tokenizer than model.path"), (tmp_path / "none", "is not a folder")):
        cfg = load_config(None, [f"model.path={tiny_model}", f"algo.distill.teacher={teacher}"])
        with pytest.raises(ModelFolderError, match=f"algo.distill.teacher: .*{says}"):
            check_before_loading(cfg)


def test_teacher_workers_score_as_the_trainer_does_and_the_policy_trains_on_what_they_send(tiny_model, teacher):
    """placement.teacher_workers: two teacher workers (each taking whole groups) give every sampled token the
    float64 teacher logprob, shipped with the samples; a policy that loads no teacher lays them out and reports the
    same reverse KL and loss as one scoring the teacher itself. Red if a worker's logprobs were misaligned (left
    instead of right), scored at temperature 1, or the policy trained on anything but what was shipped."""
    import functools

    from tandem.config import load_config
    from tandem.workers.models import TeacherWorker, teacher_logprobs
    from workers.test_models import InProcessWorkers

    cfg = load_config(None, [f"model.path={tiny_model}", f"algo.distill.teacher={teacher}",
                             f"rollout.temperature={TEMPERATURE}", "batch.micro_batch_tokens=24",
                             "data.max_prompt_tokens=8", "rollout.max_new_tokens=8"])
    workers = InProcessWorkers(functools.partial(TeacherWorker, cfg), 2)
    samples = _samples()
    scored, seconds = teacher_logprobs(workers, samples)
    assert seconds > 0 and [c.completion_ids for c in scored.completions] == [c.completion_ids for c in
                                                                           samples.completions]
    for c, want in zip(scored.completions, _float64_logprobs(teacher, samples)):
        assert (torch.tensor(c.teacher_logprobs).double() - want).abs().max() < 1e-5
    algo = AlgoConfig(distill=DistillConfig(teacher=str(teacher), coef=0.5))
    stats = []
    for on_workers, batch in ((False, samples), (True, scored)):
        torch.manual_seed(0)
        policy = Policy(str(tiny_model), "float32", False, algo, OptimConfig(lr=1e-3), 10, TEMPERATURE, 5,
                        teacher_on_workers=on_workers)
        assert (policy.teacher is None) == on_workers
        stats.append(policy.update(policy.prepare(_batch(policy, batch), len(batch)), torch.zeros(len(batch))))
    for key in ("distill/reverse_kl", "loss"):
        assert stats[1][key] == pytest.approx(stats[0][key], abs=1e-6)
    policy = Policy(str(tiny_model), "float32", False, algo, OptimConfig(lr=1e-3), 10, TEMPERATURE, 5,
                    teacher_on_workers=True)
    with pytest.raises(RuntimeError, match="came without its logprobs"):
        policy.prepare(_batch(policy, samples), len(samples))
