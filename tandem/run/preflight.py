"""What a run refuses before any model loads: the model folders, the architecture's refusals in this engine,
placement and schedule (its profile's `Refusal`s), the devices, LoRA's targets, environments, reward models, judges."""
from __future__ import annotations

import logging

import torch

from tandem.architectures import SUPPORT, ModelProfile, beyond_ulysses, profile
from tandem.config import Config, ConfigError
from tandem.modeling import check_model_folder, check_same_tokenizer
from tandem.rollout import judge
from tandem.train import lora, reward_model
from tandem.workers import placement

log = logging.getLogger(__name__)


def check_before_loading(cfg: Config) -> ModelProfile:
    """Everything that can be refused before any model loads: the model folder (and a distillation teacher's, with
    its tokenizer), the architecture in this engine, placement and schedule (`check_supported`), the devices that
    placement needs, LoRA's targets (on no weights), the environment's arguments, the reward models' checkpoints and
    the judges' folders. Returns the model's profile, resolved here once its folder is checked."""
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    check_model_folder(cfg.model.path)
    if cfg.algo.distill.teacher:
        check_model_folder(cfg.algo.distill.teacher, "algo.distill.teacher")
        check_same_tokenizer(cfg.model.path, cfg.algo.distill.teacher, "algo.distill.teacher",
                             cfg.model.trust_remote_code)
    p = profile(cfg.model.path)
    check_supported(cfg, p)
    _check_teacher_split(cfg)
    placement.check_devices(cfg)
    lora.check(cfg.lora, p, cfg.model.trust_remote_code)
    reward_model.check(cfg.rewards)
    judge.check(cfg.rewards)
    if cfg.env.name:
        from tandem.rollout.tools import make_environment

        make_environment(cfg.env.name, **cfg.env.kwargs)
    return p


def check_supported(cfg: Config, p: ModelProfile | None = None) -> None:
    """Refuse, before any model loads, what the model's profile refuses in this config (`ModelProfile.refusals`,
    in their order: the first that applies is the error). An architecture outside the zoo that passes runs where
    nothing can map its names wrongly (the embedded engine in one process); a logged warning says it is untested."""
    p = p or profile(cfg.model.path)
    for refusal in p.refusals:
        if refusal.applies(cfg, p):
            raise ConfigError(refusal.reason(cfg, p))
    if p.support is None:
        log.warning("architecture %r is not in tandem's model zoo (%s); the hf engine in one process runs it with "
                    "the checks of every sync", p.model_type, ", ".join(sorted(SUPPORT)))


def _check_teacher_split(cfg: Config) -> None:
    """A distillation teacher beside the policy runs on the policy's mesh, its forwards split over
    placement.context_parallel as the policy's are: refuse one context parallel does not cover."""
    pl = cfg.placement
    if pl.context_parallel == 1 or not cfg.algo.distill.teacher or pl.teacher_workers:
        return
    t = profile(cfg.algo.distill.teacher)
    heads = t.attention_heads // pl.tensor_parallel
    gap = beyond_ulysses(t) or (f"{heads} attention heads per tensor-parallel rank" if heads % pl.context_parallel
                                else "")
    if gap:
        raise ConfigError(f"placement.context_parallel: {pl.context_parallel}: algo.distill.teacher ({t.name}) runs "
                          f"beside the policy, its sequence split as the policy's, and has {gap}, which context "
                          "parallel does not cover; score it on workers of its own (placement.teacher_workers: 1) "
                          "or set placement.context_parallel: 1")
