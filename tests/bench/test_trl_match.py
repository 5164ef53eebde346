"""Faster is not different: tandem's first-step GRPO loss and gradient equal TRL's on the same completions (runs where
TRL is installed). TRL multiplies its k3 by the importance ratio (`use_bias_correction_kl`, its default), which is
tandem's `algo.kl_ratio_correction`; tandem's default (off) has the same loss value on policy and another gradient."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


if importlib.util.find_spec("trl") is None:
    pytest.skip("trl is not installed (pip install -e '.[bench]')", allow_module_level=True)
G, PROMPTS, NEW_TOKENS, KL, CLIP = 4, 2, 12, 0.04, 0.2


def _bench():
    spec = importlib.util.spec_from_file_location("bench_trl", ROOT / "bench" / "bench_trl.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def _reward(completions, **_) -> list[float]:
    """A deterministic reward with a spread inside groups: the number of digits in the completion."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def test_first_step_loss_and_gradient_match_trl(tmp_path):
    """Runs in a child process: importing TRL's trainer imports vLLM where it is installed, and vLLM changes the
    process it lands in (threads, environment, seeds) for every test that would run after this one."""
    r = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "first-step loss" in r.stdout and "first-step gradient" in r.stdout
    print("\n".join(r.stdout.strip().splitlines()[-2:]))


def check(tmp_path: Path) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tandem.algo import ADVANTAGES
    from tandem.rollout import Completion, Samples

    bench = _bench()
    w = bench.Workload("test", PROMPTS, G, NEW_TOKENS, 64, 2, 4, 2, 128, ignore_eos=False, micro_rows=PROMPTS * G)
    model = tmp_path / "model"
    bench.build_model(model, w)
    torch.manual_seed(0)

    # TRL's own first step (its sampling, rewards, advantages, reference logprobs and loss), recorded as it runs
    seen: dict = {}
    rewards: list[float] = []

    def reward(prompts, completions, **kw):
        out = _reward(completions)
        rewards.extend(out)
        return out

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0,
        per_device_train_batch_size=PROMPTS * G, num_generations=G, max_completion_length=NEW_TOKENS, max_steps=1,
        learning_rate=1e-5, beta=KL, epsilon=CLIP, loss_type="dapo", scale_rewards="group", temperature=1.0,
        report_to=[], save_strategy="no", logging_steps=1, disable_dropout=True, use_bias_correction_kl=True,
    )
    rows = [{"prompt": q} for q in ("12+34=", "56+78=", "90+12=", "34+56=")]
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows))
    # a reference that differs from the policy, so the KL term is not identically zero
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    compute = trainer._compute_loss

    def recording(model_, inputs):
        loss = compute(model_, inputs)
        seen.update(inputs=inputs, loss=float(loss.detach()))
        return loss

    trainer._compute_loss = recording
    trainer._clip_grad_norm = _recording_clip(trainer._clip_grad_norm, trainer.model, seen)
    trainer.train()
    inp = seen["inputs"]
    trl_grad_norm = next(row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row)

    # the same token ids, as tandem completions; TRL shuffles rows after scoring, so groups are found by prompt
    tok = trainer.processing_class
    comps, scores, group_of = [], [], {}
    for i in range(PROMPTS * G):
        prompt = inp["prompt_ids"][i][inp["prompt_mask"][i].bool()].tolist()
        n = int(inp["completion_mask"][i].sum())
        ids = inp["completion_ids"][i][:n].tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        group = group_of.setdefault(tuple(prompt), len(group_of))
        comps.append(Completion(prompt, ids, [0.0] * n, text, "stop", group))
        scores += _reward([text])
    assert sorted(scores) == sorted(rewards)
    groups = torch.tensor([c.prompt_index for c in comps])
    lengths = torch.tensor([len(c.completion_ids) for c in comps])
    adv = ADVANTAGES["grpo"](torch.tensor(scores, dtype=torch.float32), groups, lengths=lengths, eps=1e-4)
    assert torch.allclose(adv, inp["advantages"].float(), atol=1e-5), (adv, inp["advantages"])
    assert adv.abs().sum() > 0

    samples = Samples(comps, groups, PROMPTS)
    pad_id = trainer.processing_class.pad_token_id
    runs = {on: _tandem_first_step(model, trainer.ref_model, samples, adv, pad_id, on) for on in (True, False)}
    (stats, grads), (plain_stats, plain_grads) = runs[True], runs[False]
    assert stats["kl"] > 1e-4  # the KL term takes part in the comparison
    print(f"first-step loss: tandem {stats['loss']:.8f}, TRL {seen['loss']:.8f}, kl {stats['kl']:.5f}")
    assert abs(stats["loss"] - seen["loss"]) < 1e-5, (stats["loss"], seen["loss"])
    assert set(grads) == set(seen["grads"])
    worst = max(float((grads[n] - seen["grads"][n]).abs().max()) for n in grads)
    # without the correction: the same loss value (the ratio is 1 on policy), another KL gradient
    plain = max(float((plain_grads[n] - seen["grads"][n]).abs().max()) for n in grads)
    print(f"first-step gradient: |tandem - TRL| <= {worst:.2e} (norm {stats['grad_norm']:.8f}, TRL "
          f"{trl_grad_norm:.8f}); without kl_ratio_correction {plain:.2e}")
    assert worst < 1e-5 and abs(stats["grad_norm"] - trl_grad_norm) < 1e-5, (worst, stats["grad_norm"], trl_grad_norm)
    assert abs(plain_stats["loss"] - seen["loss"]) < 1e-5 and plain > 100 * max(worst, 1e-8), (plain, worst)


def _recording_clip(clip, model, seen: dict):
    """TRL's gradient clip, recording each parameter's gradient before it clips."""

    def recording(*args, **kwargs):
        seen["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return clip(*args, **kwargs)

    return recording


def _tandem_first_step(model, ref_model, samples, adv, pad_id: int, correction: bool):
    """tandem's first update of these samples: its stats, and each parameter's gradient before the clip."""
    from tandem.config import AlgoConfig, OldLogprobs, OptimConfig
    from tandem.train.batch import make_micro_batches
    from tandem.train.policy import Policy

    algo = AlgoConfig(kl_coef=KL, kl_estimator="k3", kl_ratio_correction=correction, loss_agg="token_mean",
                      clip_low=CLIP, clip_high=CLIP, adv_eps=1e-4)
    policy = Policy(str(model), "float32", False, algo, OptimConfig(lr=1e-5), 1, 1.0, NEW_TOKENS,
                    old_logprobs=OldLogprobs.CURRENT)  # TRL's on-policy shortcut: the update's own forward
    policy.ref.load_state_dict(ref_model.state_dict())
    grads: dict = {}
    clip = policy._clip

    def recording(max_norm):
        grads.update({n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None})
        return clip(max_norm)

    policy._clip = recording
    mbs = make_micro_batches(samples, budget=4096, pad_id=pad_id)
    step = policy.prepare([mbs], len(samples))
    return policy.update(step, adv), grads


if __name__ == "__main__":
    check(Path(sys.argv[1]))
