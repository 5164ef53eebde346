"""Token logprobs of a micro-batch under a model: the full forward, the prompt-once layout, entropies, and the
routing statistics of an MoE's forward. Pure functions of a model and tensors: no optimizer, no state kept."""
from __future__ import annotations

import torch

from tandem import moe
from tandem.algo import entropy_from_logprobs
from tandem.train.batch import MicroBatch
from tandem.train.stats import StepStats


def token_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False,
                   share_prompts: bool = False):
    """log pi(target) for the completion tokens of `mb` [b, T], and their entropies when asked (with a
    gradient only when an entropy bonus needs one).

    `share_prompts`: run each distinct prompt once and its rows' completions on its keys and values (`mb.shared`),
    instead of every row's full sequence: the same logprobs to float rounding, with the prompt's tokens computed once
    per group instead of once per completion. Two forwards per pass, so only where that is safe for the model's
    wrapping (not under FSDP, whose hooks expect one forward per backward).
    """
    if share_prompts and mb.shared is not None:
        return _shared_prompt_logprobs(model, mb, temperature, with_entropy, entropy_grad)
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False, logits_to_keep=mb.width + 1)
    return _logprobs(out.logits[:, :-1, :], mb.targets, mb.mask, temperature, with_entropy, entropy_grad)


def routed_logprobs(model, routing: "moe.Routing | None", mb: MicroBatch, temperature: float, replay: bool = False,
                    logits: bool = False, **kw) -> tuple[torch.Tensor, torch.Tensor | None, "moe.Record | None"]:
    """`token_logprobs` with the routers watched (an MoE model's `routing`; None: a dense model, no record): the
    record of the forward, and with `replay` the rows' recorded routes used where `mb.routed` says. `logits`: keep
    the router logits (the load-balancing loss needs them). Always the full forward: the record's rows are the
    micro-batch's [b, L] positions."""
    if routing is None:
        return (*token_logprobs(model, mb, temperature, **kw), None)
    kw["share_prompts"] = False
    given = replay and mb.routes is not None
    routes = mb.routes.flatten(0, 1) if given else None
    with routing.capture(routes, mb.routed.flatten() if given else None, logits=logits) as record:
        logp, entropy = token_logprobs(model, mb, temperature, **kw)
    return logp, entropy, record


def route_stats(mb: MicroBatch, record: "moe.Record", stats: StepStats, num_experts: int) -> None:
    """A forward's routing statistics into `stats`, over the positions with sampler routes: how many (position,
    layer) pairs the forward sent to other experts than the sampler did (`moe/route_mismatch`: 0 under replay, by
    construction), and how many the trainer's routers would have (`moe/route_mismatch_unreplayed`: what replay
    overrode; equal to the former without replay); and each expert's assignments over the real tokens."""
    used, natural = record.last("used"), record.last("natural")  # [b * L, layers, k]
    differ, pairs = (0.0, 0.0), 0.0  # added even so: every dp rank reduces the same names (a rank may have no rows)
    if mb.routes is not None:
        routed = mb.routed.flatten().to(used.device)
        given = mb.routes.flatten(0, 1).to(used.device)[routed]
        differ = tuple(float(moe.differs(r[routed], given).sum()) for r in (used, natural))
        pairs = float(routed.sum()) * used.shape[1]
    stats.add("moe/route_mismatch", differ[0], pairs)
    stats.add("moe/route_mismatch_unreplayed", differ[1], pairs)
    stats.tally("moe/expert_counts", moe.expert_counts(used, mb.attention_mask.flatten(), num_experts))


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float, with_entropy: bool,
              entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # Columns left of a short row's completion may be padding; keep them finite so masked sums stay clean.
    logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = torch.where(mask > 0, entropy_from_logprobs(logp_all), torch.zeros_like(logp))
    return logp, entropy


def shares_prompts(model) -> bool:
    """Architectures whose prompt-once logprobs are tested equal to the full forward's: Llama-family models with
    full attention everywhere (a sliding-window cache would crop the prompt's keys)."""
    cfg = model.config
    if cfg.model_type not in ("qwen2", "llama"):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    return getattr(cfg, "sliding_window", None) is None or not getattr(cfg, "use_sliding_window", True)


def _shared_prompt_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool, entropy_grad: bool):
    """`token_logprobs` the prompt-once way: the distinct prompts first, then, for each bucket of rows of similar
    width, the rows' prompt-last token and completion on top of their prompts' keys and values (selected by index,
    so differentiable: the gradients of all a prompt's completions add up in its activations). Buckets spare the
    padding of short completions next to long ones."""
    from transformers import DynamicCache

    sp, T = mb.shared, mb.width
    prompts = DynamicCache(config=model.config)
    model(input_ids=sp.ids, attention_mask=sp.attention_mask, position_ids=sp.position_ids, past_key_values=prompts,
          use_cache=True, logits_to_keep=1)
    parts, order = [], []
    for rows, width in sp.buckets:
        of_row, cols = sp.of_row[rows], slice(T - width, T)
        cache = DynamicCache([(layer.keys[of_row], layer.values[of_row]) for layer in prompts.layers],
                             config=model.config)
        attention = torch.cat([sp.attention_mask[of_row], sp.inputs_mask[rows, cols]], dim=1)
        logits = model(input_ids=sp.inputs[rows, cols], attention_mask=attention,
                       position_ids=sp.inputs_positions[rows, cols], past_key_values=cache, use_cache=True).logits
        logp, entropy = _logprobs(logits, mb.targets[rows, cols], mb.mask[rows, cols], temperature, with_entropy,
                                  entropy_grad)
        parts.append((logp, entropy))
        order.append(rows)
    if len(parts) == 1:  # every row, in order, as wide as the batch (T is the widest row)
        return parts[0]
    back = torch.argsort(torch.cat(order))  # rows back into the micro-batch's order
    left = lambda x: torch.nn.functional.pad(x, (T - x.shape[1], 0))  # noqa: E731  right-aligned to T columns
    logp = torch.cat([left(lp) for lp, _ in parts])[back]
    entropy = torch.cat([left(e) for _, e in parts])[back] if with_entropy else None
    return logp, entropy
