"""The embedded engine: grouping, logprobs that match a fresh forward pass, stop conditions, seeds, weight loads."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.modeling import load_causal_lm, load_tokenizer
from tandem.rollout import Sampling
from tandem.rollout.hf import HFEngine, draw, filter_logits, uniforms


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFEngine(str(tiny_model), seed=0)


@pytest.fixture(scope="module")
def prompts(tiny_model):
    tok = load_tokenizer(tiny_model)
    return [tok.encode(q) for q in ("12+34=", "7+5=", "99+99=")]


def recompute_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.fixture(params=["prompt per row", "prompt shared"])
def prompt_cache(request, monkeypatch):
    """Both ways the engine holds a group's prompt in decode: once for the group (tandem.rollout.hf.shared_prompt, the
    tiny Qwen2's way), or copied out to every row for the HF forward (every other architecture's)."""
    from tandem.rollout.hf import engine as hf

    if request.param == "prompt per row":
        monkeypatch.setattr(hf, "shares", lambda profile, model, n: False)
    return request.param


def test_groups_lengths_and_logprobs_match_a_fresh_forward(engine, prompts, tiny_model, prompt_cache):
    out = engine.generate(prompts, Sampling(n=4, temperature=0.7, max_new_tokens=5, ignore_eos=True, seed=3))
    assert len(out) == 12
    assert [c.prompt_index for c in out] == [0] * 4 + [1] * 4 + [2] * 4
    model = load_causal_lm(tiny_model)
    for c in out:
        assert c.prompt_ids == prompts[c.prompt_index]
        assert len(c.completion_ids) == len(c.logprobs) == 5 and c.finish_reason == "length"
        ref = recompute_logprobs(model, c.prompt_ids, c.completion_ids, 0.7)
        # left padding and the KV cache must not change the numbers (fp32): measured ~1e-6
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


def test_seed_reproduces_and_differs(engine, prompts):
    s = Sampling(n=3, temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=11)
    a = [c.completion_ids for c in engine.generate(prompts, s)]
    b = [c.completion_ids for c in engine.generate(prompts, s)]
    c = [c.completion_ids for c in engine.generate(prompts, Sampling(**{**s.__dict__, "seed": 12}))]
    assert a == b
    assert a != c


def test_per_prompt_seeds_make_a_prompts_samples_independent_of_its_batch(engine, prompts, prompt_cache):
    """Sampling.seeds (one per prompt, as a placement that spreads prompts over engines passes them): a prompt's
    samples are the same whichever prompts share its call."""
    s = Sampling(n=3, temperature=1.0, max_new_tokens=6, ignore_eos=True)
    together = engine.generate(prompts, dataclasses.replace(s, seeds=(11, 22, 33)))
    for i, seed in enumerate((11, 22, 33)):
        alone = engine.generate([prompts[i]], dataclasses.replace(s, seeds=(seed,)))
        mine = [c for c in together if c.prompt_index == i]
        assert [c.completion_ids for c in alone] == [c.completion_ids for c in mine]
        torch.testing.assert_close(torch.tensor([c.logprobs for c in alone]), torch.tensor([c.logprobs for c in mine]),
                                   rtol=0, atol=1e-5)
    other = engine.generate(prompts, dataclasses.replace(s, seeds=(11, 23, 33)))
    assert [c.completion_ids for c in other[3:6]] != [c.completion_ids for c in together[3:6]]  # the seed counts
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        engine.generate(prompts, dataclasses.replace(s, seeds=(1, 2)))


def test_greedy_equals_top_k_1(engine, prompts):
    g = engine.generate(prompts, Sampling(n=1, temperature=0.0, max_new_tokens=5, ignore_eos=True))
    k = engine.generate(prompts, Sampling(n=2, temperature=1.0, top_k=1, max_new_tokens=5, ignore_eos=True, seed=5))
    for i, c in enumerate(g):
        assert k[2 * i].completion_ids == c.completion_ids == k[2 * i + 1].completion_ids


def test_stop_token_and_stop_string(engine, prompts, tiny_model):
    base = engine.generate(prompts[:1], Sampling(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True))[0]
    stop_tok = base.completion_ids[2]
    first = base.completion_ids.index(stop_tok)
    out = engine.generate(prompts[:1], Sampling(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True,
                                                stop_token_ids=(stop_tok,)))[0]
    assert out.completion_ids == base.completion_ids[: first + 1] and out.finish_reason == "stop"
    tok = load_tokenizer(tiny_model)
    piece = tok.decode(base.completion_ids[first:first + 1])
    out = engine.generate(prompts[:1], Sampling(n=1, temperature=0.0, max_new_tokens=6, ignore_eos=True,
                                                stop=(piece,)))[0]
    assert out.finish_reason == "stop" and out.text.endswith(piece)
    assert out.text == tok.decode(base.completion_ids)[: out.text.find(piece) + len(piece)]


def test_eos_ends_completion(engine, prompts):
    eos = engine.eos_ids[0]
    # bias the LM head toward EOS so every row stops at once
    head = engine.model.get_output_embeddings().weight
    saved = head[eos].clone()
    head.data[eos] = 50 * engine.model.model.norm.weight.sign()
    try:
        out = engine.generate(prompts, Sampling(n=2, temperature=1.0, max_new_tokens=8, seed=0))
    finally:
        head.data[eos] = saved
    assert all(c.completion_ids[-1] == eos and c.finish_reason == "stop" for c in out)
    assert all(len(c.completion_ids) < 8 for c in out)


def test_filter_logits_top_p_keeps_smallest_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, 0, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, 0, 0.81))
    assert kept.tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_draw_inverts_each_rows_cumulative_distribution_at_its_uniform(top_k):
    """Row r's token is the first whose cumulative probability (after temperature and top-k) exceeds u[r] times the
    total; its logprob is under the temperature, before truncation; a filtered-out token is never drawn, even at
    the ends of [0, 1)."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3
    logits[:, 7] = float("-inf")  # a token the model rules out: never drawn
    sampling = Sampling(n=3, temperature=0.7, top_k=top_k)
    probs = torch.softmax(filter_logits(logits / 0.7, top_k, 1.0), -1).double()
    u = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    u[0], u[1] = 0.0, 1.0 - 2.0 ** -53
    tok, logp = draw(logits, sampling, u)
    for r in range(6):
        cum = probs[r].cumsum(0)
        assert tok[r] == next(i for i in range(40) if cum[i] > u[r] * cum[-1])
        assert probs[r, tok[r]] > 0
    kept = probs > 0
    assert tok[0] == kept[0].nonzero()[0, 0] and tok[1] == kept[1].nonzero()[-1, 0]  # the first and the last allowed
    assert torch.allclose(logp, torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1), atol=1e-6)


def test_a_draw_keeps_the_share_of_a_token_too_rare_for_a_float32_sum():
    """A token of probability 1e-12 after half the mass: a float32 running sum does not move past it (0.5 + 1e-12
    rounds to 0.5), so it could never be drawn; the float64 sum keeps its interval."""
    logits = torch.tensor([[0.0, -27.631, 0.0]])  # p = 0.5, ~5e-13, 0.5
    p = torch.softmax(logits.double(), -1)[0]
    inside = torch.tensor([(p[0] + p[1] / 2) / p.sum()], dtype=torch.float64)
    assert draw(logits, Sampling(temperature=1.0), inside)[0].item() == 1


def test_draws_follow_the_distribution_and_uniforms_come_from_each_prompts_generator():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0]])
    logits = probs.log().expand(20000, -1).contiguous()
    u = uniforms([torch.Generator().manual_seed(5)], 20000, 1)[:, 0]
    tok, _ = draw(logits, Sampling(temperature=1.0), u)
    freq = torch.bincount(tok, minlength=6).double() / len(tok)
    sigma = (probs[0].double() * (1 - probs[0].double()) / len(tok)).sqrt()
    assert ((freq - probs[0]).abs() <= 4 * sigma + 1e-12).all(), freq
    # generator i gives the i-th run of rows, each column its draws in step order
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    got = uniforms([a, b], 3, 4)
    want = torch.cat([torch.rand((3, 2), dtype=torch.float64, generator=torch.Generator().manual_seed(s))
                      for s in (1, 2)], 1)
    assert torch.equal(got, want)


def test_load_weights_refuses_bad_names_and_shapes_without_changing_anything(engine):
    name, p = next(iter(engine.model.named_parameters()))
    before = p.detach().clone()
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        engine.load_weights([(name, before + 1), ("nope", before)])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, before[:1])])
    assert torch.equal(p, before)
    engine.load_weights([(name, before + 1)])
    assert torch.equal(p, before + 1) and engine.last_sync_bytes == before.numel() * 4
    engine.load_weights([(name, before)])


def test_a_prompt_held_once_samples_as_the_hf_forward(tiny_model, prompts, monkeypatch):
    """The shared-prompt decoder samples the same tokens with the same logprobs as the HF forward's copied cache,
    left padding included (the prompts differ in length); it runs for a group, not for one row per prompt."""
    from tandem.rollout.hf import engine as hf, shared_prompt

    engine, built, real = HFEngine(str(tiny_model), seed=0), [], shared_prompt.SharedPromptDecoder.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(shared_prompt.SharedPromptDecoder, "__init__", recording)
    s = Sampling(n=3, temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=7)
    shared = engine.generate(prompts, s)
    assert len(built) == 1  # the path under test ran
    engine.generate(prompts, dataclasses.replace(s, n=1))
    assert len(built) == 1  # one row per prompt: nothing to share, the HF forward
    monkeypatch.setattr(hf, "shares", lambda profile, model, n: False)
    per_row = engine.generate(prompts, s)
    assert [c.completion_ids for c in shared] == [c.completion_ids for c in per_row]
    for a, b in zip(shared, per_row):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], Sampling())


def test_the_prefill_runs_each_prompt_once(engine, prompts, prompt_cache):
    """A group's n completions share their prompt: the prefill's forward sees each prompt once, not n times, and the
    rows still get their own samples (the decode steps run every row)."""
    batches = []
    hook = engine.model.model.embed_tokens.register_forward_hook(lambda m, args, out: batches.append(args[0].shape))
    try:
        out = engine.generate(prompts, Sampling(n=4, temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=1))
    finally:
        hook.remove()
    assert batches[0] == (len(prompts), max(map(len, prompts)))  # the prefill: 3 prompts, not 12 rows
    assert all(b[0] == 4 * len(prompts) for b in batches[1:])  # then every row decodes
    assert len({tuple(c.completion_ids) for c in out}) > len(prompts)  # a group's rows are sampled apart


def test_a_limit_per_prompt_stops_each_prompts_completions_at_its_own_length(engine, prompts, tiny_model,
                                                                             prompt_cache):
    out = engine.generate(prompts, Sampling(n=2, temperature=1.0, max_new_tokens=6, max_tokens=(2, 6, 4),
                                            ignore_eos=True, seed=5))
    assert [len(c.completion_ids) for c in out] == [2, 2, 6, 6, 4, 4]
    assert all(c.finish_reason == "length" and len(c.logprobs) == len(c.completion_ids) for c in out)
    model = load_causal_lm(tiny_model)
    for c in out:  # the rows that stop early leave the batch; the numbers of the others do not change
        ref = recompute_logprobs(model, c.prompt_ids, c.completion_ids, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
