"""Model cards: the README.md, in the Hugging Face style, that every checkpoint and export folder carries."""
from __future__ import annotations

from typing import Literal

CARD_FILE = "README.md"

Kind = Literal["full", "adapter", "merged"]  # a full fine-tuning's weights, a LoRA adapter, an adapter merged


def model_card(state: dict, kind: Kind) -> str:
    """The card of a checkpoint whose trainer state is `state` (its step, resolved config and the latest held-out
    evaluation's figures): base model, task and rewards, algorithm and its settings, steps, metrics, version."""
    from tandem import __version__
    from tandem.architectures import profile

    cfg, step = state["config"], state["step"]
    run, algo, batch, optim, lora = cfg["run"], cfg["algo"], cfg["batch"], cfg["optim"], cfg["lora"]
    base = cfg["model"]["path"]
    rewards = ", ".join(f"`{r['name']}` (weight {r['weight']:g})" for r in cfg["rewards"])
    tags = dict.fromkeys(["tandem", "grpo", "reinforcement-learning", algo["advantage"]]
                         + (["lora"] if lora["enabled"] else []))
    try:
        images = profile(base).images
    except (OSError, ValueError):  # the base moved since the run: its card says what a text model's does
        images = False
    pipeline = "image-text-to-text" if images else "text-generation"
    meta = ["---", f"base_model: {base}", f"library_name: {'peft' if kind == 'adapter' else 'transformers'}",
            f"pipeline_tag: {pipeline}", "tags:", *(f"- {t}" for t in tags), "---", ""]
    what = {"full": "The policy's weights (full fine-tuning)",
            "adapter": f"A LoRA adapter (rank {lora['rank']}, alpha {lora['alpha']:g}) in PEFT's format",
            "merged": f"The policy with its LoRA adapter (rank {lora['rank']}) merged into the base (`tandem export`)"}
    lines = meta + [
        f"# {run['name']}", "",
        f"{what[kind]}, after step {step} of {run['steps']} of reinforcement learning from verifiable rewards "
        f"with tandem {__version__} (GRPO and its relatives).", "",
        "## Training", "",
        "| | |", "|---|---|",
        f"| base model | `{base}` |",
        f"| task | `{cfg['data']['task']}`{' (' + cfg['data']['path'] + ')' if cfg['data'].get('path') else ''} |",
        f"| rewards | {rewards} |",
        f"| algorithm | advantage `{algo['advantage']}`, policy loss `{algo['policy_loss']}`, loss aggregation "
        f"`{algo['loss_agg']}` |",
        f"| clip | [{1 - algo['clip_low']:g}, {1 + algo['clip_high']:g}] |",
        f"| KL to the reference | {algo['kl_coef']:g} (`{algo['kl_estimator']}`) |",
        f"| batch | {batch['prompts_per_step']} prompts x {batch['group_size']} completions per step, "
        f"{batch['mini_batches']} mini-batch(es), mu {algo['mu']} |",
        f"| optimizer | AdamW, lr {optim['lr']:g}, {optim['schedule']} schedule |",
        f"| steps | {step} of {run['steps']} (seed {run['seed']}) |", "",
    ]
    figures = state.get("eval") or {}
    if figures:
        sampled = f"; pass@k and mean@k of {cfg['eval']['k']} sampled answers each" if cfg["eval"]["k"] > 1 else ""
        lines += ["## Held-out evaluation", "", f"The latest before this checkpoint, on {cfg['data']['eval_size']} "
                  f"held-out prompts (greedy accuracy and mean reward{sampled}):", "",
                  "| metric | value |", "|---|---|"]
        lines += [f"| {k.removeprefix('eval/')} | {v:.4g} |" for k, v in figures.items()
                  if isinstance(v, (int, float)) and "reward_errors" not in k]
        lines.append("")
    lines += ["## Use", "", "```python"]
    auto = "AutoModelForImageTextToText" if pipeline == "image-text-to-text" else "AutoModelForCausalLM"
    if kind == "adapter":
        lines += ["from peft import PeftModel", f"from transformers import {auto}", "",
                  f"model = PeftModel.from_pretrained({auto}.from_pretrained({base!r}), FOLDER)"]
    else:
        lines += [f"from transformers import {auto}", "", f"model = {auto}.from_pretrained(FOLDER)"]
    lines += ["```", "", "`FOLDER` is this folder. The whole resolved config is in `trainer_state.json` of the "
              "checkpoint." if kind != "merged" else "`FOLDER` is this folder.", ""]
    return "\n".join(lines)
