"""MoE router replay: the hf engine's recorded routes, the trainer's route mismatch and replay, the load metrics and
the load-balancing loss, on tiny Qwen3-MoE and Mixtral models."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

from tandem import moe  # noqa: E402
from tandem.architectures import profile  # noqa: E402
from tandem.config import AlgoConfig, OptimConfig  # noqa: E402
from tandem.rollout.base import Sampling, Samples  # noqa: E402
from tandem.rollout.hf import HFEngine  # noqa: E402
from tandem.train.batch import make_micro_batches  # noqa: E402
from tandem.train.logprobs import routed_logprobs  # noqa: E402
from tandem.train.policy import Policy  # noqa: E402

# prompts of unequal lengths (the prefill pads them) and a one-token one; n = 2 rows share each prompt; every fifth
# token stops a row, so rows finish at different steps (and keep feeding padding after)
PROMPTS = [[5, 6, 7, 8, 9], [100, 20, 30], [200], [17, 3, 250, 9, 11, 12, 13]]
SAMPLING = Sampling(n=2, temperature=1.0, max_new_tokens=6, seed=3, stop_token_ids=tuple(range(0, 258, 5)))


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "glm4_moe", "qwen3_5_moe_text", "gpt_oss",
                                              "deepseek_v3"])
def model_path(request, tmp_path_factory):
    return zoo_models.build(tmp_path_factory.mktemp(request.param) / request.param, request.param)


def _sample(path: Path, perturb: float = 0.0) -> Samples:
    """The hf engine's samples of PROMPTS; `perturb` > 0 moves its routers' weights by that share of their std (a
    sampler whose routing differs from the trainer's)."""
    engine = HFEngine(str(path))
    if perturb:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for router in moe.routers(engine.model, dict(engine.profile.routers)):
                router.weight.add_(perturb * router.weight.std() * torch.randn(router.weight.shape, generator=g))
    return Samples.of_call(engine.generate(PROMPTS, SAMPLING))


def _policy(path: Path, **algo) -> Policy:
    return Policy(str(path), "float32", False, AlgoConfig(**algo), OptimConfig(lr=1e-4), 10, 1.0,
                  SAMPLING.max_new_tokens)


def _step(policy: Policy, samples: Samples, packed: bool = False) -> dict[str, float]:
    mbs = make_micro_batches(samples, 4096, 0, packed=packed)
    return policy.update(policy.prepare([mbs], len(samples)), torch.linspace(-1, 1, len(samples)))


def test_engine_routes_are_a_teacher_forced_forwards(model_path):
    """Each completion's routes are those a single unpadded forward of prompt + completion takes, position by
    position (prefill padding, shared prompts and decode steps lined up), in the compact dtype; they survive pickling
    (how samples reach a Ray trainer)."""
    samples = pickle.loads(pickle.dumps(_sample(model_path)))
    policy_model = _policy(model_path).model
    routing = moe.Routing(policy_model, dict(profile(model_path).routers))
    lengths = {len(c.completion_ids) for c in samples.completions}
    for c in samples.completions:
        seq = c.prompt_ids + c.completion_ids
        assert c.routes.dtype == torch.uint8 and c.routes.shape == (len(seq) - 1, routing.layers, routing.top_k)
        with torch.no_grad(), routing.capture() as record:
            policy_model(input_ids=torch.tensor([seq]), use_cache=False)
        assert torch.equal(record.last("natural")[:-1].sort(-1).values, c.routes.long().sort(-1).values)
    assert len(lengths) > 2  # rows that stopped early, at different steps


def test_same_weights_route_alike_and_replay_changes_nothing(model_path):
    """Sampler and trainer with the same weights: no route differs (the batch's positions map to the sampler's), and
    replaying the sampler's routes gives the same logprobs."""
    samples = _sample(model_path)
    stats = _step(_policy(model_path), samples)
    assert stats["moe/route_mismatch"] == 0.0
    policy = _policy(model_path)
    for mb in make_micro_batches(samples, 4096, 0):
        with torch.no_grad():
            own, _, _ = routed_logprobs(policy.model, policy.routing, mb, 1.0)
            replayed, _, record = routed_logprobs(policy.model, policy.routing, mb, 1.0, replay=True)
        assert torch.allclose(own, replayed, atol=1e-5)
        assert bool(mb.routed.any())


def test_replay_removes_the_route_mismatch_and_shrinks_the_logprob_difference(model_path):
    samples = _sample(model_path, perturb=0.1)
    plain = _step(_policy(model_path), samples)
    replayed = _step(_policy(model_path, router_replay=True), samples)
    print(f"route_mismatch {plain['moe/route_mismatch']:.4f}; logprob_diff without replay {plain['logprob_diff']:.5f}"
          f" (max {plain['logprob_diff_max']:.4f}), with replay {replayed['logprob_diff']:.5f}"
          f" (max {replayed['logprob_diff_max']:.4f})")
    assert plain["moe/route_mismatch"] > 0.01
    assert replayed["moe/route_mismatch"] == 0.0  # the experts used are the sampler's
    # what the trainer's routers would have chosen: the same figure as without replay (same weights, same batch)
    assert replayed["moe/route_mismatch_unreplayed"] == plain["moe/route_mismatch"]
    assert "moe/route_mismatch_unreplayed" not in plain
    assert replayed["logprob_diff"] < 0.5 * plain["logprob_diff"]
    policy = _policy(model_path, router_replay=True)
    for mb in make_micro_batches(samples, 4096, 0):  # the routes a replayed forward used are the sampler's
        with torch.no_grad():
            _, _, record = routed_logprobs(policy.model, policy.routing, mb, 1.0, replay=True)
        routed = mb.routed.flatten()
        used, given = record.last("used")[routed], mb.routes.flatten(0, 1)[routed]
        assert not bool(moe.differs(used, given).any())
        assert bool(moe.differs(record.last("natural")[routed], given).any())


def test_padding_free_routes_replays_and_balances_as_padded(model_path):
    """Padding-free, the router record's rows are the real tokens in order: the same route mismatch, expert load,
    load-balancing loss and loss as padded, with and without replay (which uses the sampler's routes there too:
    mismatch 0). Red if the routes were given in the padded layout's rows (replay refuses the row count) or the
    stats counted other positions' routes."""
    samples = _sample(model_path, perturb=0.1)
    for algo in ({}, {"router_replay": True, "router_aux_coef": 0.5}):
        padded = _step(_policy(model_path, **algo), samples)
        policy = _policy(model_path, **algo)
        packed = _step(policy, samples, packed=True)
        assert policy.padding_free == profile(model_path).packs
        assert packed.keys() == padded.keys()
        for name in ("moe/route_mismatch", "moe/expert_load_max", "moe/load_entropy", "moe/aux_loss", "loss",
                     "logprob_diff"):
            if name in padded:
                assert packed[name] == pytest.approx(padded[name], abs=1e-5), (algo, name)
        if algo:
            assert packed["moe/route_mismatch"] == 0.0


def test_replayed_routers_still_get_a_gradient(model_path):
    samples = _sample(model_path, perturb=0.1)
    policy = _policy(model_path, router_replay=True)
    (mb,) = make_micro_batches(samples, 4096, 0)
    logp, _, _ = routed_logprobs(policy.model, policy.routing, mb, 1.0, replay=True)
    (logp * mb.mask).sum().backward()
    for router in policy.routing.routers:
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0


def test_aux_loss_is_transformers_load_balancing_loss(model_path):
    """Without replay the load-balancing loss is transformers' `load_balancing_loss_func` over the padded batch's real
    tokens; the policy adds coef times it to its loss and reports it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    samples = _sample(model_path)
    (mb,) = make_micro_batches(samples, 4096, 0)

    def aux_loss(policy, as_one_group: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(tandem's loss, transformers') of one forward; `as_one_group`: DeepSeek-V3's router chooses among all
        experts instead of within its best group, the one choice transformers' function knows (the top-k of all;
        tandem counts the experts the forward used)."""
        for router in (r for r in policy.routing.routers if as_one_group and hasattr(r, "topk_group")):
            router.num_group = router.topk_group = 1
        with torch.no_grad(), policy.routing.capture(logits=True) as record:
            out = policy.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                               position_ids=mb.position_ids, use_cache=False, output_router_logits=True)
        routing = policy.routing
        return (moe.load_balancing_loss(record, mb.attention_mask, routing.num_experts),
                load_balancing_loss_func(out.router_logits, routing.num_experts, routing.top_k, mb.attention_mask))

    ours, theirs = aux_loss(_policy(model_path, router_aux_coef=0.0), as_one_group=True)
    assert abs(float(ours) - float(theirs)) < 1e-6
    policy = _policy(model_path, router_aux_coef=0.0)
    ours = aux_loss(policy)[0]  # as the model routes (DeepSeek-V3: its best group)
    off = _step(policy, samples)
    on = _step(_policy(model_path, router_aux_coef=0.5), samples)
    assert "moe/aux_loss" not in off
    assert on["moe/aux_loss"] == pytest.approx(float(ours), abs=1e-6)
    assert on["loss"] - off["loss"] == pytest.approx(0.5 * float(ours), abs=1e-5)
    # None: the model's own; GLM-4.5 and DeepSeek-V3 have none (they balance by their routers' correction bias), so 0
    assert _policy(model_path).aux_coef == (getattr(policy.model.config, "router_aux_loss_coef", 0.0) or 0.0)


def test_moe_metrics_for_an_moe_only(model_path, tiny_model):
    samples = _sample(model_path)
    stats = _step(_policy(model_path), samples)
    k, experts = 2, 4
    assert k / experts <= stats["moe/expert_load_max"] <= 1.0
    assert 0.0 < stats["moe/load_entropy"] <= 1.0
    # the load-balancing loss where the model has one (GLM-4.5 balances by its routers' correction bias instead)
    assert "moe/route_mismatch" in stats and ("moe/aux_loss" in stats) == (_policy(model_path).aux_coef > 0)
    for c in samples.completions:  # routes absent (a vLLM sampler): no mismatch to report, the load still is
        c.routes = None
    unrouted = _step(_policy(model_path), samples)
    assert "moe/route_mismatch" not in unrouted and "moe/expert_load_max" in unrouted
    dense = Policy(str(tiny_model), "float32", False, AlgoConfig(), OptimConfig(lr=1e-4), 10, 1.0, 4)
    assert dense.routing is None
    assert HFEngine(str(tiny_model)).routing is None


def test_load_metrics_definitions():
    counts = torch.tensor([[3.0, 3.0, 3.0, 3.0], [12.0, 0.0, 0.0, 0.0]])  # balanced; all on expert 0 (k = 1)
    m = moe.load_metrics(counts, top_k=1)
    assert m["moe/expert_load_max"] == pytest.approx(1.0)
    assert m["moe/load_entropy"] == pytest.approx(0.5)
    assert moe.load_metrics(counts[:1] * 2, top_k=2)["moe/expert_load_max"] == pytest.approx(0.5)


class _Tool:
    """Answers each of the first two turns with a fixed observation, then is done."""

    stop: tuple[str, ...] = ()

    def __init__(self):
        self.seen = 0

    def reset(self, prompt: str) -> str:
        return ""

    def step(self, turn_text: str):
        from types import SimpleNamespace

        self.seen += 1
        done = self.seen >= 3
        return SimpleNamespace(observation="" if done else "12+34=", reward=None, done=done,
                               tool=None if done else "echo", error=None)


def test_multiturn_routes_line_up_with_the_conversation(model_path):
    """A conversation carries its last turn's routes (every position before that turn's last token); the trainer
    finds them where its positions are: no mismatch with the same weights, the environment's tokens unrouted."""
    from tandem.modeling import load_tokenizer
    from tandem.rollout.multiturn import TurnLimits, converse

    engine = HFEngine(str(model_path))
    comps = converse(engine, load_tokenizer(model_path), PROMPTS[:2], Sampling(n=2, max_new_tokens=4, seed=1,
                     ignore_eos=True), _Tool, TurnLimits(3, 64))
    assert all(0 in c.loss_mask and c.routes is not None for c in comps)
    for c in comps:
        last_sampled = max(i for i, m in enumerate(c.loss_mask) if m)
        assert c.routes.shape[0] == len(c.prompt_ids) + last_sampled
    stats = _step(_policy(model_path), Samples.of_call(comps))
    assert stats["moe/route_mismatch"] == 0.0
