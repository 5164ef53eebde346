"""tandem's C decode attention (tandem/rollout/native.py) against a float64 reference, its build and its fallback."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.rollout import llama_decode, native
from tandem.rollout.hf import HFEngine

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")


def reference(q, k, v, seen, scale, bf16: bool) -> torch.Tensor:
    """Attention in float64 from the inputs the kernel reads: a bf16 cache's keys, values and rounded queries."""
    if bf16:
        q = q.to(torch.bfloat16)
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = torch.einsum("bhd,bhld->bhl", q.double(), k) * scale
    weights = torch.softmax(scores.masked_fill(~seen[:, None, :], float("-inf")), -1)
    return torch.einsum("bhl,bhld->bhd", weights, v)


def inputs(B, H, KV, L, D, dtype, holes: bool, seed: int = 0):
    """q [B, H, D]; k, v [B, KV, L, D] as slices of a larger cache (strides as the decoders pass them); a mask
    with holes (left padding) where asked."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H + KV, D, generator=g)[:, :H]  # a view into q and k heads, as decode_layers passes it
    cache = torch.randn(B, KV, L + 7, D, generator=g).to(dtype), torch.randn(B, KV, L + 7, D, generator=g).to(dtype)
    seen = torch.ones(B, L + 3, dtype=torch.bool)
    if holes:
        seen[:, : L // 2] = torch.rand(B, L // 2, generator=g) > 0.5
        seen[:, L - 1] = True  # a row always sees its own token
    return q, cache[0][:, :, :L], cache[1][:, :, :L], seen[:, :L]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,KV,D", [(8, 4, 64), (4, 4, 64), (8, 2, 128), (6, 2, 8), (12, 4, 40)])
@pytest.mark.parametrize("L", [1, 3, 37])
def test_matches_a_float64_reference(H, KV, D, L, dtype):
    """Head shapes (each its own build: 1 to 3 query heads per KV head, head dims 8 to 128, 40 leaving a partial
    value block), lengths below and across the kernel's 4-position blocks, masks with holes, both cache dtypes."""
    q, k, v, seen = inputs(3, H, KV, L, D, dtype, holes=L > 2)
    out = native.decode_attention(q, k, v, seen, D ** -0.5)
    ref = reference(q, k, v, seen, D ** -0.5, dtype == torch.bfloat16)
    assert out.dtype == torch.float32 and out.shape == (3, H, D)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5), float((out.double() - ref).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_held_once_per_group_is_attended_with_each_rows_own_keys(dtype):
    """The cascade layout: U prompts' keys [U, KV, P, D] (left padding masked) read by each of their n rows, then
    the row's own keys; one softmax over both, as if the prompt were copied into every row's cache."""
    U, n, P, L, H, KV, D = 3, 4, 6, 5, 8, 2, 64
    g = torch.Generator().manual_seed(1)
    q = torch.randn(U * n, H, D, generator=g)
    pk, pv = (torch.randn(U, KV, P, D, generator=g).to(dtype) for _ in range(2))
    pseen = torch.ones(U, P, dtype=torch.bool)
    pseen[0, :2] = pseen[2, :1] = False
    k, v = (torch.randn(U * n, KV, L + 3, D, generator=g).to(dtype)[:, :, :L] for _ in range(2))
    out = native.decode_attention(q, k, v, None, D ** -0.5, prompt=(pk, pv, pseen))
    rows = lambda t: t.repeat_interleave(n, 0)  # noqa: E731
    whole = (torch.cat([rows(pk), k], 2), torch.cat([rows(pv), v], 2),
             torch.cat([rows(pseen), torch.ones(U * n, L, dtype=torch.bool)], 1))
    ref = reference(q, *whole, D ** -0.5, dtype == torch.bfloat16)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5), float((out.double() - ref).abs().max())


def test_agrees_with_sdpa_as_the_decoders_call_it():
    q, k, v, seen = inputs(5, 8, 4, 29, 64, torch.float32, holes=True)
    sdpa = llama_decode._attention(q, k, v, seen, 0.125).reshape(5, 8, 64)
    assert torch.allclose(native.decode_attention(q, k, v, seen, 0.125), sdpa, atol=1e-6)


def test_a_nan_in_a_masked_slot_does_not_reach_the_output():
    """A cache slot a row does not see may hold anything (the decoders allocate their caches uninitialised)."""
    q, k, v, seen = inputs(2, 4, 2, 9, 16, torch.float32, holes=False)
    seen = seen.clone()
    seen[:, 2] = False
    k[:, :, 2], v[:, :, 2] = float("nan"), float("nan")
    out = native.decode_attention(q, k, v, seen, 0.25)
    assert torch.isfinite(out).all()
    ref = reference(q, k.nan_to_num(), v.nan_to_num(), seen, 0.25, False)  # what the slot holds does not matter
    assert torch.allclose(out.double(), ref, atol=2e-6)


def test_threads_split_the_work_and_give_the_same_result():
    """Above ~1 MB of keys and values the rows are split over torch's thread count: each (row, KV head) is
    computed alone, so the split changes nothing."""
    q, k, v, seen = inputs(64, 8, 4, 160, 64, torch.float32, holes=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.decode_attention(q, k, v, seen, 0.125)
        torch.set_num_threads(3)
        three = native.decode_attention(q, k, v, seen, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


def test_shapes_and_dtypes_it_cannot_serve_are_named():
    cpu = torch.device("cpu")
    assert native.unsupported(8, 4, 64, torch.float32, torch.bfloat16, cpu) == ""
    assert "multiple of 8" in native.unsupported(8, 4, 60, torch.float32, torch.float32, cpu)
    assert "multiple of 8" in native.unsupported(64, 2, 64, torch.float32, torch.float32, cpu)
    assert "float32 queries" in native.unsupported(8, 4, 64, torch.bfloat16, torch.bfloat16, cpu)
    assert "CPU" in native.unsupported(8, 4, 64, torch.float32, torch.float32, torch.device("meta"))


def test_a_build_for_one_head_shape_refuses_another():
    """Each head shape has its own build (its loop bounds are constants): one called with another shape's
    tensors must refuse, not read out of bounds."""
    q, k, v, seen = inputs(2, 8, 4, 5, 64, torch.float32, holes=False)
    lib, _ = native.library(4, 64)  # built for 4 query heads per KV head, called with 2
    out = torch.empty(2, 8, 64)
    dims = (native.ctypes.c_int64 * 26)(2, 8, 4, 64, *q.stride()[:2], *out.stride()[:2], 0, 1, *[0] * 7,
                                        *native._segment(k, v, seen, 1))
    assert lib.tandem_decode_attention(q.data_ptr(), out.data_ptr(), None, None, None, k.data_ptr(), v.data_ptr(),
                                       seen.data_ptr(), dims, 0, 0.125, 1) == 3


def test_a_failed_build_leaves_torch_and_native_raises(tiny_model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native.library.cache_clear()
    try:
        lib, why = native.library(2, 8)
        assert lib is None and "no-such-compiler" in why
        assert HFEngine(str(tiny_model), seed=0).decode_kernel == "torch"
        assert "PyTorch ops and SDPA" in caplog.text and "no-such-compiler" in caplog.text
        with pytest.raises(RuntimeError, match="decode_kernel=native"):
            HFEngine(str(tiny_model), seed=0, decode_kernel="native")
    finally:
        native.library.cache_clear()


def test_a_fresh_cache_builds_one_library(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        lib, why = native.library(2, 64)
        assert lib is not None, why
        built = [p.name for p in tmp_path.iterdir()]
        assert len(built) == 1 and built[0].startswith("decode-g2-d64-"), built  # no temporary left
    finally:
        native.library.cache_clear()


def test_a_compiler_without_openmp_or_march_native_still_builds_one(tmp_path, monkeypatch):
    """The build falls back flag by flag (clang without libomp, a compiler that does not know -march=native): the
    kernel then runs single-threaded, for the compiler's baseline target, and gives the same result."""
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\nfor a in \"$@\"; do case $a in -fopenmp|-march=native) exit 1;; esac; done\n"
                  f"exec {kernels.compiler()} \"$@\"\n")
    cc.chmod(0o755)
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    native.library.cache_clear()
    try:
        q, k, v, seen = inputs(64, 8, 4, 40, 64, torch.float32, holes=True)
        out = native.decode_attention(q, k, v, seen, 0.125)
        assert torch.allclose(out.double(), reference(q, k, v, seen, 0.125, False), atol=2e-6)
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("whole_step", [True, False], ids=["whole step in C", "C attention in torch ops"])
@pytest.mark.parametrize("shared", [False, True], ids=["prompt per row", "prompt shared"])
def test_the_engine_samples_alike_with_either_kernel(tiny_model, shared, whole_step, monkeypatch):
    """auto picks the C kernel where it builds: the whole step in one C call, or, where PyTorch's BLAS cannot be
    called from C, PyTorch ops around the C attention; the tokens and logprobs match the torch kernel's (float
    rounding apart), with the prompt in each row's cache and held once per group (the threshold lowered to reach
    it)."""
    from tandem.rollout import Sampling

    for kernel in llama_decode.SHARED_PROMPT_MIN_BYTES:
        monkeypatch.setitem(llama_decode.SHARED_PROMPT_MIN_BYTES, kernel, 1 if shared else 1 << 62)
    if not whole_step:
        monkeypatch.setattr(native, "sgemm", lambda: (None, "no BLAS here"))
    calls = []
    step = native.DecodeStep.__call__
    monkeypatch.setattr(native.DecodeStep, "__call__", lambda self, *a: calls.append(1) or step(self, *a))

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    s = Sampling(n=3, temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=5)
    auto, ops = HFEngine(str(tiny_model), seed=0), HFEngine(str(tiny_model), seed=0, decode_kernel="torch")
    assert (auto.decode_kernel, ops.decode_kernel) == ("native", "torch")
    a = auto.generate(prompts, s)
    assert len(calls) == (7 if whole_step else 0)  # 8 tokens: the first from the prefill
    b = ops.generate(prompts, s)
    assert len(calls) == (7 if whole_step else 0)
    assert [c.completion_ids for c in a] == [c.completion_ids for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


def random_decoder_model(arch: str):
    """A small Llama-family model with every weight random, biases and norms included (a fresh model's biases are
    zero, which would hide a bias the step drops): Qwen2 (q/k/v biases, tied head) or Llama (biases on every
    projection, its own head)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=61, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False, attention_bias=True, mlp_bias=True))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2).add_(1.0 if p.ndim == 1 and p.shape[0] == 64 else 0.0)  # norms near 1
    return model.eval()


def prefilled(model, prompts: list[list[int]]):
    """The HF prefill of left-padded prompts, as the engine runs it: (cache, attention mask, next positions)."""
    from transformers import DynamicCache

    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
    return cache, attn, pos[:, -1] + 1


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True], ids=["prompt per row", "prompt shared"])
@torch.inference_mode()
def test_the_whole_step_in_c_equals_the_step_in_torch_ops(arch, kv_dtype, shared, monkeypatch):
    """native.DecodeStep against decode_layers in PyTorch ops around the same C attention (which the HF-forward
    tests hold to the model), step after step on the same tokens: logits to float rounding, the same keys and
    values written to the caches."""
    model = random_decoder_model(arch)
    llama_decode.fuse_parameters(model)
    for kernel in llama_decode.SHARED_PROMPT_MIN_BYTES:
        monkeypatch.setitem(llama_decode.SHARED_PROMPT_MIN_BYTES, kernel, 1 if shared else 1 << 62)
    n, prompts = 3, [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    cache, attn, nxt = prefilled(model, prompts)
    c_step = llama_decode.StaticDecoder(model, cache, n, 6, attn, kv_dtype, "native")
    with monkeypatch.context() as m:
        m.setattr(native, "sgemm", lambda: (None, "no BLAS here"))
        ops = llama_decode.StaticDecoder(model, cache, n, 6, attn, kv_dtype, "native")
    assert c_step.whole_step is not None and ops.whole_step is None and c_step.shared == ops.shared == shared
    positions, g = nxt.repeat_interleave(n), torch.Generator().manual_seed(1)
    for _ in range(6):
        tokens = torch.randint(0, 61, (len(positions),), generator=g)
        a, b = c_step.step(tokens, positions), ops.step(tokens, positions)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()
        positions = positions + 1
    for mine, theirs in zip(c_step.k + c_step.v, ops.k + ops.v):
        written = slice(mine.shape[2] - 6, None)  # the generated slots (the prompt's were copied by both)
        assert torch.allclose(mine[:, :, written].float(), theirs[:, :, written].float(), atol=1e-5, rtol=1e-2)


@torch.inference_mode()
def test_the_whole_step_refuses_arguments_out_of_range():
    model = random_decoder_model("qwen2")
    cache, attn, nxt = prefilled(model, [[5, 6, 7]])
    dec = llama_decode.StaticDecoder(model, cache, 2, 4, attn, torch.float32, "native")
    step, pos = dec.whole_step, nxt.repeat_interleave(2)
    assert dec.shared  # the kernel's layout: 4 own slots per row, after the prompt held once
    for tokens, slots, length in (([3, 61], [0, 0], 1), ([3, 4], [1, 1], 1), ([3, 4], [0, 0], 5)):  # token, slot, L
        with pytest.raises(RuntimeError, match="out of range"):
            step(torch.tensor(tokens), pos, torch.tensor(slots), length)
    with pytest.raises(RuntimeError, match="out of range"):  # a rotary position past the table
        step(torch.tensor([3, 4]), pos + 1000, torch.tensor([0, 0]), 1)
    with pytest.raises(ValueError, match="int64"):
        step(torch.tensor([3, 4], dtype=torch.int32), pos, torch.tensor([0, 0]), 1)
    assert step(torch.tensor([3, 4]), pos, torch.tensor([0, 0]), 1).shape == (2, 61)
