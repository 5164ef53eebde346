"""The one loading path for local Hugging Face checkpoints (tokenizer and causal LM): demo, tests and real models."""
from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelFolderError(ValueError):
    pass


def check_model_folder(path: str) -> Path:
    """Refuse a path that is not a local causal-LM folder before anything heavy happens."""
    if not path:
        raise ModelFolderError("model.path: empty; point it at a local Hugging Face model folder "
                               "(config.json + *.safetensors + tokenizer files), or run `tandem demo`")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelFolderError(f"model.path: {path!r} is not a folder; point it at a local Hugging Face model "
                               "folder (downloads are not done at run time: `huggingface-cli download` it first)")
    if not (p / "config.json").is_file():
        raise ModelFolderError(f"model.path: {path!r} has no config.json; is it a Hugging Face model folder?")
    if not any(p.glob("*.safetensors")):
        raise ModelFolderError(f"model.path: {path!r} has no *.safetensors weights; convert the checkpoint with "
                               "`save_pretrained(..., safe_serialization=True)`")
    return p


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load the folder's tokenizer. A bare `tokenizer.json` loads as PreTrainedTokenizerFast, unchanged."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    cfg = p / "tokenizer_config.json"
    declared = json.loads(cfg.read_text()).get("tokenizer_class") if cfg.is_file() else None
    # transformers 5 may pick a tokenizer class from the *model* type and re-split text; a folder that says
    # PreTrainedTokenizerFast (as tandem's own do) is loaded as exactly that.
    if declared in ("PreTrainedTokenizerFast", "TokenizersBackend") or (declared is None and (p / "tokenizer.json").is_file()):
        tok = PreTrainedTokenizerFast.from_pretrained(str(p))
    else:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per load drowns the run's own progress

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    return model


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a completion: the generation config's EOS (may be a list) and the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for src in (gen_eos, tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return sorted(ids)
