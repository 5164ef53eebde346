"""Token logprobs of a micro-batch under a model: the full forward (padded or padding-free), the prompt-once layout,
entropies, and the routing statistics of an MoE's forward. Pure functions of a model and tensors: no optimizer, no
state kept."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from transformers.cache_utils import LinearAttentionLayer

from tandem import moe
from tandem.algo import entropy_from_logprobs
from tandem.modeling import rope_positions
from tandem.train import context_parallel
from tandem.train.batch import MicroBatch
from tandem.train.stats import StepStats


def token_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False,
                   share_prompts: bool = False, packed: bool = True, context_group: "dist.ProcessGroup | None" = None):
    """log pi(target) for the completion tokens of `mb` [b, T], and their entropies when asked (with a
    gradient only when an entropy bonus needs one).

    `share_prompts`: run each distinct prompt once and its rows' completions on its keys and values (`mb.shared`),
    instead of every row's full sequence: the same logprobs to float rounding, with the prompt's tokens computed once
    per group instead of once per completion. Two forwards per pass, so only where that is safe for the model's
    wrapping (not under FSDP, whose hooks expect one forward per backward).

    Otherwise, where `mb.packed` is set, the padding-free forward: the rows end to end with no attention mask, each
    row's positions restarting at 0 (transformers confines attention to a row from those), the LM head on the
    positions that predict a completion token only; their logprobs are put in their [b, T] places (zeros elsewhere).
    `packed` False: the padded forward even so (a model whose profile does not pack, scoring micro-batches laid out
    for one that does: a teacher of another architecture). With `context_group` (context parallel: a model set up by
    `context_parallel.use`) this rank runs its chunk of the padding-free sequence and the results are summed over
    the group, the whole micro-batch's on every rank.
    """
    if share_prompts and mb.shared is not None:
        return _shared_prompt_logprobs(model, mb, temperature, with_entropy, entropy_grad)
    if packed and mb.packed is not None:
        return _packed_logprobs(model, mb, temperature, with_entropy, entropy_grad, context_group)
    if context_group is not None:
        raise RuntimeError("context parallel runs padding-free micro-batches (MicroBatch.packed): set "
                           "batch.padding_free: true")
    with _whole_rows(model, mb) as (input_ids, position_ids):
        out = model(input_ids=input_ids, attention_mask=mb.attention_mask, position_ids=position_ids,
                    use_cache=False, logits_to_keep=mb.width + 1, **mb.images)
    return _logprobs(out.logits[:, :-1, :], mb.targets, mb.mask, temperature, with_entropy, entropy_grad)


def _packed_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool, entropy_grad: bool,
                     context_group: "dist.ProcessGroup | None" = None):
    """`token_logprobs` on the padding-free layout (`mb.packed`): the K kept logits against their targets, scattered
    into zeros [b, T] (differentiably: each kept logit's gradient comes back from its place); under context
    parallel, this rank's kept logits, then the sum over `context_group`."""
    p, (b, T) = mb.packed, mb.targets.shape
    if context_group is None:
        with _whole_rows(model, mb, packed=True) as (input_ids, position_ids):
            out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                        logits_to_keep=p.keep, **mb.images)
        logits, at = out.logits, p.at
    else:  # text only: context parallel refuses vision-language models
        logits, at = context_parallel.forward(model, p, context_group)
    targets, mask = mb.targets.flatten()[at], mb.mask.flatten()[at]
    logp, entropy = _logprobs(logits, targets[None], mask[None], temperature, with_entropy, entropy_grad)

    def put(x: torch.Tensor) -> torch.Tensor:
        whole = x.new_zeros(b * T).index_put((at,), x[0]).view(b, T)
        return whole if context_group is None else context_parallel.summed(whole, context_group)

    return put(logp), None if entropy is None else put(entropy)


@contextlib.contextmanager
def _whole_rows(model, mb: MicroBatch, packed: bool = False):
    """The ids and positions for a forward over whole rows (prompt and completion) with their images, left-padded or
    with `packed` end to end (`mb.packed`). A completion may hold the image placeholder token (a model may sample
    it), which the sampler fed as a token (decoding feeds no pixels) and the model would take for one more image's
    place: it enters as another id, and its own embedding is put back in its place by a hook on the embedding layer
    (inside the model's forward, so FSDP has the weights gathered); the images fill only the prompt's placeholders.
    A 3-D rotary model (mRoPE: `rope_positions`) runs at its own positions for the prompt, the completion continuing
    them as text; they are computed on the padded layout and, packed, taken at the real tokens (in order, as
    `mb.packed` lays them), behind the 1-D positions that tell transformers where each row starts ([4, 1, N]).
    Yields (input_ids, position_ids)."""
    token = getattr(model.config, "image_token_id", None)
    ids, positions = (mb.packed.ids, mb.packed.positions) if packed else (mb.input_ids, mb.position_ids)
    if not mb.images or token is None:
        yield ids, positions
        return
    sampled = torch.zeros_like(mb.input_ids, dtype=torch.bool)
    if mb.width:  # a completion's columns are its targets' (their padding is pad_id, never an image token)
        sampled[:, -mb.width:] = mb.targets == token
    rope = rope_positions(model, mb.input_ids, mb.attention_mask, mb.images, sampled)
    if packed:
        real = mb.attention_mask.bool()
        sampled = sampled[real].view(1, -1)
        if rope is not None:
            positions = torch.cat([positions[None], rope[0][:, real].unsqueeze(1).to(positions)])
    elif rope is not None:
        positions = rope[0]
    if not sampled.any():
        yield ids, positions
        return

    def put_back(module, args, out):
        own = type(module).forward(module, torch.full((), token, device=out.device))  # forward(): no hooks again
        return torch.where(sampled.unsqueeze(-1).to(out.device), own.to(out.dtype), out)

    handle = model.get_input_embeddings().register_forward_hook(put_back)
    try:
        yield ids.masked_fill(sampled, 0 if token != 0 else 1), positions
    finally:
        handle.remove()


def routed_logprobs(model, routing: "moe.Routing | None", mb: MicroBatch, temperature: float, replay: bool = False,
                    logits: bool = False, **kw) -> tuple[torch.Tensor, torch.Tensor | None, "moe.Record | None"]:
    """`token_logprobs` with the routers watched (an MoE model's `routing`; None: a dense model, no record): the
    record of the forward, and with `replay` the rows' recorded routes used where `mb.routed` says. `logits`: keep
    the router logits (the load-balancing loss needs them). Always a whole-row forward (padded or padding-free, as
    `kw`'s `packed` says): the record's rows are the micro-batch's [b, L] positions that forward ran
    (`forward_positions`)."""
    if routing is None:
        return (*token_logprobs(model, mb, temperature, **kw), None)
    kw["share_prompts"] = False
    given = replay and mb.routes is not None
    ran = forward_positions(mb, kw.get("packed", True)) if given else None
    routes = mb.routes.flatten(0, 1)[ran] if given else None
    with routing.capture(routes, mb.routed.flatten()[ran] if given else None, logits=logits) as record:
        logp, entropy = token_logprobs(model, mb, temperature, **kw)
    return logp, entropy, record


def forward_positions(mb: MicroBatch, packed: bool = True) -> torch.Tensor:
    """[b * L] bool: which positions of the padded layout (`mb.input_ids`, row-major) a whole-row forward of `mb`
    runs, in its order: all of them padded; padding-free (`packed` and `mb.packed` set), the real tokens, which
    `mb.packed` lays out in that order. What an MoE's router record's rows are."""
    real = mb.attention_mask.flatten().bool()
    return real if packed and mb.packed is not None else torch.ones_like(real)


def route_stats(mb: MicroBatch, record: "moe.Record", stats: StepStats, num_experts: int, packed: bool = True) -> None:
    """A forward's routing statistics into `stats`, over the positions with sampler routes: how many (position,
    layer) pairs the forward sent to other experts than the sampler did (`moe/route_mismatch`: 0 under replay, by
    construction), and how many the trainer's routers would have (`moe/route_mismatch_unreplayed`: what replay
    overrode; equal to the former without replay); and each expert's assignments over the real tokens. `packed`:
    as the forward ran (`routed_logprobs`)."""
    used, natural = record.last("used"), record.last("natural")  # [the forward's positions, layers, k]
    ran = forward_positions(mb, packed)
    differ, pairs = (0.0, 0.0), 0.0  # added even so: every dp rank reduces the same names (a rank may have no rows)
    if mb.routes is not None:
        routed = mb.routed.flatten()[ran].to(used.device)
        given = mb.routes.flatten(0, 1)[ran].to(used.device)[routed]
        differ = tuple(float(moe.differs(r[routed], given).sum()) for r in (used, natural))
        pairs = float(routed.sum()) * used.shape[1]
    stats.add("moe/route_mismatch", differ[0], pairs)
    stats.add("moe/route_mismatch_unreplayed", differ[1], pairs)
    stats.tally("moe/expert_counts", moe.expert_counts(used, mb.attention_mask.flatten()[ran], num_experts))


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


def _shared_prompt_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool, entropy_grad: bool):
    """`token_logprobs` the prompt-once way: the distinct prompts first, then, for each bucket of rows of similar
    width, the rows' prompt-last token and completion on top of their prompts' keys and values (selected by index,
    so differentiable: the gradients of all a prompt's completions add up in its activations). Buckets spare the
    padding of short completions next to long ones.

    A linear-attention layer (Qwen3.5's Gated DeltaNet) carries its prompt's recurrent state and convolution window
    instead of keys and values, and reads every position in order: padding between a prompt and its row would decay
    the state and enter the window. There each row's tokens run left-aligned, right after its prompt (padding after
    them, which nothing real reads), and their logprobs are moved back right-aligned.

    A 3-D rotary model (mRoPE) runs its prompts at the positions it gives them itself (`rope_positions`), and each
    row's tokens as text after its prompt: their 1-D positions plus the prompt's delta, in all three sections."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    sp, T = mb.shared, mb.width
    rope = rope_positions(model, sp.ids, sp.attention_mask, sp.images)  # prompts only: every image token an image's
    prompts = DynamicCache(config=model.config)
    model(input_ids=sp.ids, attention_mask=sp.attention_mask, position_ids=sp.position_ids if rope is None else rope[0],
          past_key_values=prompts, use_cache=True, logits_to_keep=1, **sp.images)  # a vision model's images: once
    linear = any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in prompts.layers)
    parts, order = [], []
    for rows, width in sp.buckets:
        of_row, cols = sp.of_row[rows], slice(T - width, T)
        cache = DynamicCache(config=model.config)
        for i, held in enumerate(prompts.layers):
            if isinstance(held, LinearAttentionCacheLayerMixin):
                cache.layers[i] = _CarriedState.of_rows(held, of_row)
            else:
                cache.layers[i].update(held.keys[of_row], held.values[of_row])
        inputs, mask, positions = sp.inputs[rows, cols], sp.inputs_mask[rows, cols], sp.inputs_positions[rows, cols]
        if rope is not None:
            positions = positions + rope[1][of_row, None]
        targets, loss_mask = mb.targets[rows, cols], mb.mask[rows, cols]
        if linear:  # left-aligned: each row's first token right after its prompt
            shift = width - mask.sum(1, keepdim=True)
            left = (torch.arange(width, device=mask.device) + shift) % width
            inputs, mask, positions, targets, loss_mask = (x.gather(1, left) for x in (inputs, mask, positions,
                                                                                           targets, loss_mask))
        attention = torch.cat([sp.attention_mask[of_row], mask], dim=1)
        logits = model(input_ids=inputs, attention_mask=attention, position_ids=positions, past_key_values=cache,
                       use_cache=True).logits
        logp, entropy = _logprobs(logits, targets, loss_mask, temperature, with_entropy, entropy_grad)
        if linear:  # back right-aligned, as the micro-batch's columns are
            right = (torch.arange(width, device=mask.device) - shift) % width
            logp, entropy = logp.gather(1, right), None if entropy is None else entropy.gather(1, right)
        parts.append((logp, entropy))
        order.append(rows)
    if len(parts) == 1:  # every row, in order, as wide as the batch (T is the widest row)
        return parts[0]
    back = torch.argsort(torch.cat(order))  # rows back into the micro-batch's order
    left = lambda x: torch.nn.functional.pad(x, (T - x.shape[1], 0))  # noqa: E731  right-aligned to T columns
    logp = torch.cat([left(lp) for lp, _ in parts])[back]
    entropy = torch.cat([left(e) for _, e in parts])[back] if with_entropy else None
    return logp, entropy


class _CarriedState(LinearAttentionLayer):
    """A linear-attention layer's cache for rows run on top of their prompts: each row's prompt's recurrent state and
    convolution window, selected by index from the prompts' pass (so differentiable), then replaced, never written in
    place (transformers' own layer copies into its tensors, which the backward of the prompts' pass still reads)."""

    @classmethod
    def of_rows(cls, held: LinearAttentionLayer, of_row: torch.Tensor) -> "_CarriedState":
        layer = cls(number_of_states=held.number_of_states)
        for i in range(held.number_of_states):
            layer.conv_states[i] = held.conv_states[i][of_row]
            layer.recurrent_states[i] = held.recurrent_states[i][of_row]
            layer.conv_kernel_size[i] = held.conv_kernel_size[i]
            layer.is_conv_states_initialized[i] = layer.is_recurrent_states_initialized[i] = True
            layer.has_previous_state[i] = True
        layer.device, layer.dtype = held.device, held.dtype
        return layer

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        window = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx] = window[..., -self.conv_kernel_size[state_idx]:]
        return window

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states
