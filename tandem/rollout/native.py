"""The hf engine's C kernels through ctypes: the decode attention (`tandem/kernels/decode_attention.c`) and the
whole decode step around it (`decode_step.c`, one library, built once per head shape), and the sampling draw
(`sample.c`, a library of its own); built and cached by `tandem.kernels`.

The step's matrix products call the `sgemm_` inside PyTorch's own CPU library (`sgemm`), the routine its
`torch.mm` calls, so the step adds no BLAS and runs the products at PyTorch's speed. No compiler, or a failed
build, leaves PyTorch ops and SDPA in use (`rollout.decode_kernel`).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tandem.kernels import FLAGS, KERNELS, built

SOURCE = KERNELS / "decode_step.c"  # includes decode_attention.c: one library holds both entry points
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # MAXG, MAXD in the C source
MAX_VOCAB = 64 * 8192  # sample.c: BLOCK x MAXBLOCKS (512 Ki entries; the largest vocabularies have 256 Ki)


@functools.cache
def library(group: int, head_dim: int) -> tuple[ctypes.CDLL | None, str]:
    """The kernels (decode attention and step) built for `group` query heads per KV head of `head_dim` dims,
    loaded, and ""; or None and why they are not available (once per process and shape)."""
    flags = [*FLAGS, f"-DTANDEM_G={group}", f"-DTANDEM_C={head_dim // 8}"]
    lib, why = built(f"decode-g{group}-d{head_dim}", SOURCE, [KERNELS / "decode_attention.c", KERNELS / "exp.h"],
                     flags)
    if lib is None:
        return None, why
    fn = lib.tandem_decode_attention
    fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.tandem_decode_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int64,
                                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.tandem_decode_step.restype = ctypes.c_int
    return lib, ""


@functools.cache
def sampler() -> tuple[ctypes.CDLL | None, str]:
    """The draw (`sample.c`, for any model) built, loaded, and ""; or None and why not (once per process)."""
    lib, why = built("sample", KERNELS / "sample.c", [KERNELS / "exp.h"], FLAGS)
    if lib is None:
        return None, why
    lib.tandem_sample.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.tandem_sample.restype = ctypes.c_int
    return lib, ""


def sample(logits: torch.Tensor, temperature: float, u: torch.Tensor | None, alive: torch.Tensor | None = None,
           pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [rows, V] (float32, CPU, last dim contiguous) and its logprob under the
    temperature, by `sample.c`: at its uniform `u` [rows] (float64), or greedy where `u` is None (temperature
    then unused: logprobs of the plain logits); rows where `alive` [rows] (bool) is False get `pad` and logprob 0.
    The same draw as `hf._draw`'s PyTorch ops without top-k and top-p (float rounding apart)."""
    lib, why = sampler()
    if lib is None:
        raise RuntimeError(f"native sampling is not available: {why}")
    rows, V = logits.shape
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("native sample: float32 CPU logits with a contiguous last dim")
    if (u is not None and (u.dtype != torch.float64 or u.shape != (rows,) or not u.is_contiguous())) or \
            (alive is not None and (alive.dtype != torch.bool or alive.shape != (rows,) or not alive.is_contiguous())):
        raise ValueError("native sample: u must be [rows] float64 and alive [rows] bool, contiguous")
    tok = torch.empty(rows, dtype=torch.long)
    logp = torch.empty(rows, dtype=torch.float32)
    inv_t = 1.0 / temperature if u is not None else 1.0
    rc = lib.tandem_sample(logits.data_ptr(), rows, V, logits.stride(0), inv_t,
                           None if u is None else u.data_ptr(), None if alive is None else alive.data_ptr(), pad,
                           tok.data_ptr(), logp.data_ptr())
    if rc:
        raise RuntimeError(f"native sample failed (code {rc}): a vocabulary of {V} is beyond its {MAX_VOCAB}")
    return tok, logp


def unsupported(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                device: torch.device) -> str:
    """Why the kernel does not serve a decoder of these shapes and dtypes ("" if it does; whether it builds is
    `library`'s to say)."""
    if device.type != "cpu":
        return f"it runs on CPU, the model is on {device.type}"
    if dtype != torch.float32 or kv_dtype not in (torch.float32, torch.bfloat16):
        return f"it takes float32 queries and a float32 or bfloat16 cache, not {dtype} and {kv_dtype}"
    if heads % kv_heads or heads // kv_heads > MAX_GROUP or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return (f"{heads} query heads over {kv_heads} KV heads of {head_dim} dims: it needs a whole group of at "
                f"most {MAX_GROUP} and a head dim that is a multiple of 8 up to {MAX_HEAD_DIM}")
    return ""


def _segment(k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None, group: int) -> list[int]:
    """A run of cached positions as the C side reads it (see `segment_t`)."""
    if k.stride(3) != 1 or v.stride(3) != 1 or (seen is not None and (seen.stride(1) != 1 or seen.dtype != torch.bool)):
        raise ValueError("decode_attention needs keys and values with a contiguous last dim and a bool mask")
    return [k.shape[2], group, *k.stride()[:3], *v.stride()[:3], 0 if seen is None else seen.stride(0)]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None, scale: float,
                     prompt: tuple | None = None) -> torch.Tensor:
    """One query per row and head (q [B, H, D], float32) against the row's cached keys and values (k, v
    [B, KV, L, D], float32 or bfloat16) where `seen` [B, L] (bool; None: all) allows, and, with `prompt` = (keys,
    values, seen) of [U, KV, P, D] and [U, P], against its group's prompt first (row b reads prompt b // (B / U)),
    held once for the group's rows: out [B, H, D], float32, one softmax over both. The same result as SDPA with
    enable_gqa to float rounding (a bf16 cache's queries rounded to bf16 as SDPA's would be; its output stays
    float32, where SDPA's is rounded to bf16). Only for shapes and dtypes that `unsupported` accepts."""
    B, H, D = q.shape
    lib, why = library(H // k.shape[1], D)
    if lib is None:
        raise RuntimeError(f"native decode attention is not available: {why}")
    if q.stride(2) != 1 or q.dtype != torch.float32:
        raise ValueError("decode_attention needs float32 queries with a contiguous last dim")
    out = torch.empty((B, H, D), dtype=torch.float32, device=q.device)
    if prompt is None:
        pk = pv = pseen = None
        head = [0, 1] + [0] * 7
    else:
        pk, pv, pseen = prompt
        head = _segment(pk, pv, pseen, B // pk.shape[0])
    dims = (ctypes.c_int64 * 26)(B, H, k.shape[1], D, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *head,
                                 *_segment(k, v, seen, 1))
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rc = lib.tandem_decode_attention(q.data_ptr(), out.data_ptr(), ptr(pk), ptr(pv), ptr(pseen), k.data_ptr(),
                                     v.data_ptr(), ptr(seen), dims, int(k.dtype == torch.bfloat16), scale,
                                     torch.get_num_threads())
    if rc:
        raise RuntimeError(f"native decode attention failed (code {rc}) on q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out


@functools.cache
def sgemm() -> tuple[int | None, str]:
    """The address of the `sgemm_` (Fortran BLAS) that PyTorch's CPU matrix products call, and ""; or None and why
    not (a PyTorch built without a BLAS that exports it)."""
    folder = Path(torch.__file__).parent / "lib"
    for lib in sorted(folder.glob("libtorch_cpu.*")):
        try:
            return ctypes.cast(ctypes.CDLL(str(lib)).sgemm_, ctypes.c_void_p).value, ""
        except (OSError, AttributeError):
            continue
    return None, f"no sgemm_ in PyTorch's CPU library ({folder}): its matrix products use another BLAS"


class _Layer(ctypes.Structure):  # layer_t in decode_step.c
    _fields_ = [(name, ctypes.c_void_p) for name in ("norm1", "w_qkv", "b_qkv", "w_o", "b_o", "norm2", "w_gu", "b_gu",
                                                     "w_down", "b_down", "k", "v", "pk", "pv")]


class _Decoder(ctypes.Structure):  # decoder_t in decode_step.c
    _fields_ = [*((name, ctypes.c_int64) for name in ("B", "E", "H", "KV", "D", "I", "V", "Vin", "T", "layers", "S",
                                                      "P", "n")),
                ("spk", ctypes.c_int64 * 3), ("spv", ctypes.c_int64 * 3),
                *((name, ctypes.c_void_p) for name in ("pseen", "embed", "norm", "head", "cos", "sin", "x", "h",
                                                       "qkv", "att", "gu", "act", "y")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int), ("sgemm", ctypes.c_void_p),
                ("layer", ctypes.POINTER(_Layer))]


class DecodeStep:
    """A lean decoder's whole decode step in one C call (`decode_step.c`), built from the model's fused layer
    weights (`llama_decode.fused_layers`), its rotary tables (`llama_decode.rotary_tables`) and the decoder's
    caches, which it writes in place: the own caches k, v [B, KV, S, D] (contiguous), and with `prompt` = (keys,
    values, seen) per layer a group's prompt held once. Holds every tensor whose address it passes, so none is
    freed while it lives; build it again after the weights change (`fused_layers` may hold copies)."""

    def __init__(self, model, fused: list[tuple], rotary: tuple[torch.Tensor, torch.Tensor], k: list[torch.Tensor],
                 v: list[torch.Tensor], prompt: tuple | None = None):
        cfg, attn = model.config, model.model.layers[0].self_attn
        B, KV, S, D = k[0].shape
        H, E, I = cfg.num_attention_heads, cfg.hidden_size, fused[0][6].shape[0] // 2
        self.lib, why = library(H // KV, D)
        address, why_not = sgemm()
        if self.lib is None or address is None:
            raise RuntimeError(f"native decode step is not available: {why or why_not}")
        if any(not (t.is_contiguous() and t.dtype == k[0].dtype) for t in (*k, *v)):
            raise ValueError("native decode step: the own caches must be contiguous, of one dtype (written in place)")
        self._keep: list[torch.Tensor] = []
        pk, pv, pseen = prompt if prompt is not None else ([None] * len(k), [None] * len(k), None)
        if prompt is not None:  # read in place with the strides of layer 0's, which must hold for every layer
            pk, pv = [t.contiguous() for t in pk], [t.contiguous() for t in pv]
        layers = (_Layer * len(fused))(*(
            _Layer(*map(self._address, (n1.weight, w_qkv, b_qkv, w_o, b_o, n2.weight, w_gu, b_gu, w_d, b_d, kc, vc,
                                        pkc, pvc)))
            for (n1, w_qkv, b_qkv, w_o, b_o, n2, w_gu, b_gu, w_d, b_d), kc, vc, pkc, pvc in zip(fused, k, v, pk, pv)))
        work = [torch.empty((B, w), dtype=torch.float32) for w in (E, E, (H + 2 * KV) * D, H * D, 2 * I, I, E)]
        strides = (lambda t: (ctypes.c_int64 * 3)(*(t.stride()[:3] if t is not None else (0, 0, 0))))
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        self.vocab = head.shape[0]
        self.decoder = _Decoder(
            B, E, H, KV, D, I, self.vocab, embed.shape[0], rotary[0].shape[0], len(fused), S,
            pk[0].shape[2] if prompt is not None else 0, B // pk[0].shape[0] if prompt is not None else 1,
            strides(pk[0]), strides(pv[0]), *map(self._address, (pseen, embed, model.model.norm.weight, head,
                                                                 *rotary, *work)),
            model.model.norm.variance_epsilon, attn.scaling, int(k[0].dtype == torch.bfloat16), address, layers)
        self._layers = layers  # the decoder's pointer to them does not keep them alive

    def _address(self, t: torch.Tensor | None) -> int | None:
        """The address of `t` (contiguous, made so if need be), kept alive with this step."""
        if t is None:
            return None
        if t.dtype not in (torch.float32, torch.bfloat16, torch.bool) or t.device.type != "cpu":
            raise ValueError(f"native decode step: a {t.dtype} tensor on {t.device}")
        t = t.contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, length: int,
                 seen: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, V] after feeding `tokens` [rows] at rotary `positions` [rows], row r's key and value stored
        at its own slot `slots[r]` (all int64), attention over its own slots 0..length-1 where `seen` [rows, >=
        length] (bool, None: all) allows."""
        if any(t.dtype != torch.long for t in (tokens, positions, slots)):
            raise ValueError("native decode step: tokens, positions and slots must be int64")
        if seen is not None and (seen.dtype != torch.bool or seen.stride(1) != 1):
            raise ValueError("native decode step: seen must be a bool mask with a contiguous last dim")
        tokens, positions, slots = tokens.contiguous(), positions.contiguous(), slots.contiguous()
        logits = torch.empty((len(tokens), self.vocab), dtype=torch.float32)
        rc = self.lib.tandem_decode_step(
            ctypes.addressof(self.decoder), len(tokens), tokens.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            length, None if seen is None else seen.data_ptr(), 0 if seen is None else seen.stride(0),
            logits.data_ptr(), torch.get_num_threads())
        if rc:
            why = {4: "an argument out of range", 2: "a shape out of range", 3: "a shape out of range"}.get(rc, "no memory")
            raise RuntimeError(f"native decode step failed (code {rc}: {why})")
        return logits
