"""`tandem export`: a LoRA checkpoint merged into its base model, written as a plain Hugging Face folder."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tandem.architectures import profile
from tandem.modeling import check_model_folder, load_causal_lm, load_processor, load_tokenizer
from tandem.run.card import CARD_FILE, model_card
from tandem.train.lora import ADAPTER_CONFIG


def export_merged(checkpoint: str, out: str, base: str | None = None, dtype: str = "float32",
                  force: bool = False) -> Path:
    """A LoRA checkpoint as a plain Hugging Face folder: its adapter merged into the base model (the folder its
    adapter_config.json names, or `base`), saved with the checkpoint's tokenizer (a vision-language model's: its
    processor); loadable by transformers and vLLM.
    An existing `out` is refused unless `force` (the CLI refuses, before this, an `out` that holds the checkpoint or
    a run: tandem.run.directory.refuse_export_into); the folder is written beside it and renamed into place, so `out`
    is never half written (a kill leaves the old one, or none, and a hidden `.NAME.tmp-PID` folder)."""
    from peft import PeftModel  # transformers and PEFT: only an export needs them

    folder, target = Path(checkpoint), Path(out)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"export: {checkpoint} has no {ADAPTER_CONFIG}: it is not a LoRA checkpoint (a full "
                         "fine-tuning checkpoint is a Hugging Face model folder already: load it as is)")
    if target.exists() and not (force and target.is_dir()):
        what = "a folder" if target.is_dir() else "a file, not a folder"
        raise ValueError(f"export: {out} exists already ({what}); choose another output folder"
                         + (", or pass --force to replace it" if target.is_dir() else ""))
    base = base or json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    check_model_folder(base)  # names the problem, e.g. a base moved since training: pass --base
    model = PeftModel.from_pretrained(load_causal_lm(base, dtype), str(folder)).merge_and_unload()
    tmp, old = (target.with_name(f".{target.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        # a vision-language model's processor (its image processor and tokenizer; the checkpoint holds it), else
        # the tokenizer: what a run saves beside the weights
        (load_processor(folder) if profile(base).images else load_tokenizer(folder)).save_pretrained(tmp)
        if (folder / "trainer_state.json").is_file():  # a tandem checkpoint: its card, for the merged model
            (tmp / CARD_FILE).write_text(model_card(json.loads((folder / "trainer_state.json").read_text()), "merged"))
        if target.exists():  # --force: the old folder goes only once the new one is whole
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            if old.exists():
                os.rename(old, target)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return target
