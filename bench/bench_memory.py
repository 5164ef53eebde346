"""Device memory per GRPO phase (generate, logprobs, update, sync): all resident vs fine-grained offload vs SFT.

    .venv/bin/python bench/bench_memory.py [--hidden 256] [--layers 4] [--vocab 32768] [--prompts 8] [--n 4]
        [--prompt-len 16] [--new-tokens 48] [--micro-tokens 1024]

Runs with 1 torch thread. A random Qwen2 is built here (the demo tokenizer, a model vocabulary of --vocab so the
logits weigh what they do in real models; no download). One GRPO step (KL on, so a reference model is loaded;
mu = 1, one mini-batch) runs three ways on the same prompts and tokens:

  (a) resident: policy (params, grads, AdamW state), reference and engine weights stay on the device throughout;
  (b) offload: the engine sleeps while training; the policy and reference are offloaded while generating; the
      reference is offloaded while updating; only the policy's weights are resident for the sync;
  (c) SFT: the same model's forward/backward/AdamW step on the same micro-batches (cross-entropy on the completion
      tokens), the plain fine-tuning that GRPO is compared against.

Peak per phase = bytes resident at its start + peak of the bytes allocated during it (activations, logits,
gradients, the KV cache, new optimizer state). On CUDA both come from the allocator (`max_memory_allocated`, reset
per phase); on CPU from a dispatch-mode tracker of live storages (CPU has no allocator statistics), which sees every
tensor the ops create and when its storage dies. The same script runs unchanged on a GPU machine.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.util import residency  # noqa: E402
from tandem.config import AlgoConfig, OldLogprobs, OptimConfig  # noqa: E402
from tandem.rollout.base import Sampling  # noqa: E402

MB = 1 << 20


class LiveStorages(TorchDispatchMode):
    """Peak bytes of the storages created by ops inside the mode (weakrefs tell when each one dies)."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.live, self.peak = 0, 0
        self._existing = existing  # storages resident before the phase: counted there, not here
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t.untyped_storage())
        return out

    def _track(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self._refs or key in self._existing or st.nbytes() == 0:
            return  # a view or an in-place result: its storage is already counted
        n = st.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        self._refs[key] = weakref.ref(st, lambda _, k=key, n=n: self._gone(k, n))

    def _gone(self, key: int, n: int) -> None:
        self._refs.pop(key, None)
        self.live -= n


class Meter:
    """Per-phase peak device bytes; `tensors()` lists what stays resident between phases (weights, state)."""

    def __init__(self, device: torch.device, tensors):
        self.device, self.tensors = device, tensors
        self.rows: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            self.rows[name] = torch.cuda.max_memory_allocated()
            return
        before = self.tensors()
        start = residency.storage_bytes(before, self.device)
        with LiveStorages({s._cdata for s in residency.unique_storages(before)}) as mode:
            yield
        self.rows[name] = start + mode.peak


def build_model(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tandem.data import arithmetic
    from tandem.demo import build_tokenizer

    tok = build_tokenizer(arithmetic.corpus(), 300)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=max(vocab, len(tok)), hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=3 * hidden,
                      max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def grpo_step(model_dir: Path, args, device: torch.device, offload: bool, lora=None) -> tuple[dict[str, int], dict]:
    """One GRPO step; `lora` (a LoraConfig) trains adapters instead (bench/bench_lora.py compares the two)."""
    from tandem.modeling import load_causal_lm
    from tandem.rollout.base import Samples
    from tandem.rollout.hf import HFEngine
    from tandem.train.batch import make_micro_batches
    from tandem.train.policy import Policy

    policy = Policy(str(model_dir), "float32", False, AlgoConfig(kl_coef=0.05), OptimConfig(lr=1e-5), 1, 1.0,
                    args.new_tokens, device=str(device), old_logprobs=OldLogprobs.CURRENT, lora=lora)
    engine = HFEngine(str(model_dir), model=load_causal_lm(model_dir).to(device))

    meter = Meter(device, lambda: [t for g in ("params", "grads", "optim", "ref") for t in policy._tensors(g)]
                  + list(engine._params.values()))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    sampling = Sampling(n=args.n, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)

    if offload:
        policy.to_host("params", "grads", "optim", "ref")
    with meter.phase("generate"):
        completions = engine.generate(prompts, sampling)
    advantages = torch.randn(len(completions), generator=g)
    mbs = [mb for mb in make_micro_batches(Samples.of_call(completions), args.micro_tokens, 0)]
    to_device(mbs, device)
    if offload:
        engine.sleep()
        # on-policy with KL: this phase runs only the reference; the policy's own forward comes with the update
        policy.to_device("ref")
    with meter.phase("logprobs"):
        prepared = policy.prepare([mbs], len(completions))
    if offload:
        policy.to_host("ref")
        policy.to_device("params", "optim")
    with meter.phase("update"):
        policy.update(prepared, advantages)
    # what training keeps besides the weights: a gradient per trainable parameter (alive until the optimizer step),
    # AdamW's state, and the reference model
    accounted = {"grads": sum(p.numel() * p.element_size() for p in policy.params),
                 "optim": policy.residency()["optim"], "ref": policy.residency()["ref"]}
    if offload:
        policy.to_host("optim", "grads")
        engine.wake()
    with meter.phase("sync"):
        engine.load_weights(policy.named_weights())
    residency_now = {**policy.residency(), "engine": engine.resident_bytes()}
    return meter.rows, {"tokens": sum(mb.tokens for mb in mbs), "micro_batches": len(mbs),
                        "resident_after_sync": residency_now, "mbs": mbs, "accounted": accounted}


def to_device(mbs, device: torch.device) -> None:
    for mb in mbs:
        mb.to(device)


def sft_step(model_dir: Path, mbs, device: torch.device) -> dict[str, int]:
    """Forward/backward/AdamW of the same model on the same micro-batches: cross-entropy on completion tokens."""
    from tandem.modeling import load_causal_lm

    model = load_causal_lm(model_dir).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tensors = lambda: list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None] + [  # noqa: E731
        v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    meter = Meter(device, tensors)
    total = sum(mb.tokens for mb in mbs)
    with meter.phase("update"):
        for mb in mbs:
            T = mb.width
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                           use_cache=False, logits_to_keep=T + 1).logits[:, :-1, :].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb.targets.reshape(-1),
                                                    reduction="none").view_as(mb.mask)
            ((nll * mb.mask).sum() / total).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return meter.rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--micro-tokens", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        resident, info = grpo_step(model_dir, args, device, offload=False)
        offloaded, info = grpo_step(model_dir, args, device, offload=True)
        sft = sft_step(model_dir, info["mbs"], device)
    print(f"device {device.type}, 1 torch thread; Qwen2 hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}; {args.prompts} prompts x {args.n}, {info['tokens']} completion tokens in "
          f"{info['micro_batches']} micro-batches of <= {args.micro_tokens} tokens")
    print(f"{'phase':10} {'(a) resident MB':>16} {'(b) offload MB':>15} {'(c) SFT MB':>11}")
    for phase in ("generate", "logprobs", "update", "sync"):
        s = f"{sft['update'] / MB:11.1f}" if phase == "update" else f"{'':11}"
        print(f"{phase:10} {resident[phase] / MB:16.1f} {offloaded[phase] / MB:15.1f} {s}")
    pa, pb, ps = max(resident.values()), max(offloaded.values()), sft["update"]
    print(f"{'peak':10} {pa / MB:16.1f} {pb / MB:15.1f} {ps / MB:11.1f}")
    print(f"GRPO peak / SFT peak: resident {pa / ps:.2f}, fine-grained offload {pb / ps:.2f} (target <= 1.15)")


if __name__ == "__main__":
    main()
