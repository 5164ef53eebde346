"""Training's fused SiLU gate and RMS norm (tandem.train.fused): HF's math to float rounding, forward and backward,
on the architectures it names; PyTorch's ops wherever the kernels do not apply. And its grouped-query attention:
HF's SDPA attention without the copied key/value heads."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from tandem import kernels
from tandem.train import fused

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")


def _grads(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fn(*inputs), and the gradients of a fixed random projection of it."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.dtype)
    (out * weights).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def test_silu_mul_is_silu_times_up_forward_and_backward():
    """Against float64 PyTorch ops, over gates from -100 (where exp's clamp acts) to +100."""
    g = torch.cat([torch.randn(3, 5, 1000) * 4, torch.linspace(-100, 100, 15 * 8).view(3, 5, 8)], dim=-1)
    u = torch.randn_like(g)
    out, (dg, du) = _grads(fused.SiluMul.apply, g, u)
    ref, (rg, ru) = _grads(lambda a, b: torch.nn.functional.silu(a) * b, g.double(), u.double())
    for what, mine, theirs in (("out", out, ref), ("d gate", dg, rg), ("d up", du, ru)):
        assert torch.allclose(mine.double(), theirs, rtol=2e-6, atol=1e-6), (what, (mine.double() - theirs).abs().max())


@pytest.mark.parametrize("weight_grad", [True, False], ids=["weight trains", "weight frozen"])
def test_rms_norm_is_hf_rms_norm_forward_and_backward(weight_grad):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    norm = Qwen2RMSNorm(96, eps=1e-6).double()
    norm.weight.data = torch.randn(96, dtype=torch.float64)
    norm.weight.requires_grad_(weight_grad)
    x = torch.randn(4, 7, 96) * 3
    w = norm.weight.detach().float().requires_grad_(weight_grad)
    xx = x.clone().requires_grad_(True)
    out = fused.RmsNorm.apply(xx, w, 1e-6)
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * proj).sum().backward()
    xd = x.double().requires_grad_(True)
    ref = norm(xd)
    (ref * proj.double()).sum().backward()
    assert torch.allclose(out.double(), ref.detach(), rtol=2e-6, atol=1e-6)
    assert torch.allclose(xx.grad.double(), xd.grad, rtol=1e-5, atol=1e-6), (xx.grad.double() - xd.grad).abs().max()
    if weight_grad:
        assert torch.allclose(w.grad.double(), norm.weight.grad, rtol=1e-5, atol=1e-5)
    else:
        assert w.grad is None


def test_the_gradients_are_the_same_bits_run_after_run_with_threads():
    """The weight gradient is summed per thread, then over threads in order: two runs, two threads, same bits, and
    the sum of one thread's run to float rounding."""
    torch.manual_seed(0)
    x, w = torch.randn(257, 64), torch.randn(64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [_grads(lambda a, b: fused.RmsNorm.apply(a, b, 1e-6), x, w) for _ in range(2)]
    finally:
        torch.set_num_threads(before)
    (o1, (x1, w1)), (o2, (x2, w2)) = runs
    assert torch.equal(o1, o2) and torch.equal(x1, x2) and torch.equal(w1, w2)
    _, (_, one_thread) = _grads(lambda a, b: fused.RmsNorm.apply(a, b, 1e-6), x, w)  # the conftest's 1 thread
    assert torch.allclose(w1, one_thread, rtol=1e-5, atol=1e-5)  # both threads' rows counted


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_a_fused_model_trains_as_the_hf_model(arch, tmp_path):
    """fuse() swaps every gated SiLU MLP and RMS norm's class (parameters and names unchanged) and the model's
    logits and every parameter's gradient match the unfused model's to float rounding."""
    from zoo_models import build

    from tandem.modeling import load_causal_lm

    path = build(tmp_path / arch, arch)
    plain, model = load_causal_lm(path), load_causal_lm(path)
    names = [n for n, _ in model.named_parameters()]
    count = fused.fuse(model)
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)  # qwen3: q_norm and k_norm per layer
    assert count == layers + norms
    assert [n for n, _ in model.named_parameters()] == names
    assert all(type(layer.mlp).__name__.startswith("Fused") for layer in model.model.layers)
    ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (plain, model):
        logits = m(input_ids=ids).logits
        logits.logsumexp(-1).sum().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = outs
    assert torch.allclose(l0, l1, atol=2e-5), (l0 - l1).abs().max()
    for n in names:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-5), (n, (g0[n] - g1[n]).abs().max())


def test_other_dtypes_keep_hf_ops_and_no_compiler_fuses_nothing(tiny_model, monkeypatch):
    """A bfloat16 input runs the HF module's own forward (the same bits); without a kernel nothing is swapped."""
    from tandem.modeling import load_causal_lm

    model = load_causal_lm(tiny_model)
    norm = model.model.norm
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.bfloat16)
    expected = norm(x)
    fused.fuse(model)
    assert type(norm).__name__ == "FusedQwen2RMSNorm" and torch.equal(norm(x), expected)
    monkeypatch.setattr(fused, "library", lambda: (None, "no C compiler"))
    other = load_causal_lm(tiny_model)
    assert fused.fuse(other) == 0 and type(other.model.norm).__name__ == "Qwen2RMSNorm"


def test_each_named_class_is_hf_s_gated_mlp_or_rms_norm():
    """The classes fuse() takes have, word for word, Qwen2MLP's or Qwen2RMSNorm's forward in this transformers."""
    def source(name: str) -> str:
        arch = {"Qwen2": "qwen2", "Llama": "llama", "Qwen3": "qwen3", "Mistral": "mistral", "Qwen2Moe": "qwen2_moe",
                "Qwen3Moe": "qwen3_moe", "Mixtral": "mixtral", "Phi3": "phi3"}[name.removesuffix("MLP").removesuffix(
                    "RMSNorm")]
        module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        return inspect.getsource(getattr(module, name).forward)

    assert {source(n) for n in fused._MLPS} == {source("Qwen2MLP")}
    assert {source(n) for n in fused._NORMS} == {source("Qwen2RMSNorm")}


def test_the_policy_trains_with_the_fused_ops_on_cpu(tiny_model):
    from tandem.config import AlgoConfig, OptimConfig
    from tandem.train.policy import Policy

    policy = Policy(str(tiny_model), "float32", False, AlgoConfig(kl_coef=0.04), OptimConfig(), 10, 1.0, 8)
    for model in (policy.model, policy.ref):
        assert type(model.model.layers[0].mlp).__name__ == "FusedQwen2MLP"
        assert type(model.model.norm).__name__ == "FusedQwen2RMSNorm"
        assert model.config._attn_implementation == fused.GROUPED_SDPA


def test_grouped_attention_is_hf_sdpa_without_copying_the_heads(tiny_model, tmp_path, monkeypatch):
    """On padded rows (so HF passes a mask) and on the prompt-once layout's completions (a mask and a cache), a GQA
    model with `group_attention` gives HF's SDPA logits and gradients, and never copies a key/value head; the
    config it saves still names HF's attention."""
    from transformers.integrations import sdpa_attention

    from tandem.modeling import load_causal_lm
    from tandem.rollout.base import Completion
    from tandem.train.batch import collate
    from tandem.train.policy import token_logprobs

    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: copies.append(1) or repeat_kv(*a))
    hf, grouped = load_causal_lm(tiny_model), load_causal_lm(tiny_model)
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads  # GQA: the case HF copies heads for
    assert fused.group_attention(grouped) and hf.config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.config.vocab_size, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, :1] = 0, 0
    rows = [Completion(p, torch.randint(3, 60, (n,), generator=g).tolist(), [0.0] * n, "", "length", i // 2)
            for i, (p, n) in enumerate([([5, 6, 7], 4), ([5, 6, 7], 6), ([8, 9], 5), ([8, 9], 2)])]
    mb = collate(rows, list(range(4)), 0, share_prompts=True)
    assert mb.shared is not None
    outs = []
    for model in (hf, grouped):
        copies.clear()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logp, _ = token_logprobs(model, mb, 1.0, share_prompts=True)
        ((logits * mask[..., None]).logsumexp(-1).sum() + (logp * mb.mask).sum()).backward()
        outs.append((logits.detach(), logp.detach(), {n: p.grad for n, p in model.named_parameters()}, len(copies)))
    (l0, p0, g0, hf_copies), (l1, p1, g1, grouped_copies) = outs
    assert hf_copies > 0 and grouped_copies == 0
    assert torch.allclose(l0, l1, atol=1e-5) and torch.allclose(p0, p1, atol=1e-5), (l0 - l1).abs().max()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-4, atol=1e-6), (n, (g0[n] - g1[n]).abs().max())
    grouped.config.save_pretrained(tmp_path)
    assert fused.GROUPED_SDPA not in (tmp_path / "config.json").read_text()
