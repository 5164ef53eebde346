"""The one loading path for local Hugging Face checkpoints (tokenizer, causal LM, sequence classifier): demo, tests and
real models."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelFolderError(ValueError):
    pass


def check_model_folder(path: str, field: str = "model.path") -> Path:
    """Refuse a path that is not a whole local causal-LM folder before anything heavy happens: its config, every
    weights file and its tokenizer are checked (cheaply: JSON, safetensors headers and file sizes, names). `field`:
    the config field the errors name (the policy's, or another model's such as algo.distill.teacher)."""
    if not path:
        raise ModelFolderError(f"{field}: empty; point it at a local Hugging Face model folder "
                               "(config.json + *.safetensors + tokenizer files), or run `tandem demo`")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelFolderError(f"{field}: {path!r} is not a folder; point it at a local Hugging Face model "
                               "folder (tandem downloads nothing at run time: fetch one first, e.g. "
                               f"`hf download <repo id> --local-dir {path}`)")
    check_model_files(p, field)
    check_tokenizer_files(p, field)
    return p


def check_model_files(folder: Path, field: str = "model.path") -> None:
    """What a model load reads: config.json with a model_type, and safetensors files that are whole."""
    if not (folder / "config.json").is_file():
        if (folder / "adapter_config.json").is_file():
            raise ModelFolderError(f"{field}: {str(folder)!r} is a LoRA adapter, not a whole model; merge it into "
                                   f"its base with `tandem export {folder} MERGED` and use MERGED")
        raise ModelFolderError(f"{field}: {str(folder)!r} has no config.json; is it a Hugging Face model folder?")
    config = read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise ModelFolderError(f"{folder / 'config.json'}: expected a JSON object, got {type(config).__name__}; "
                               "copy the model's config.json again")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise ModelFolderError(f"{folder / 'config.json'}: no 'model_type' (transformers picks the model class by "
                               f"it; keys here: {sorted(config)[:8]}); is this a model's config.json?")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelFolderError(f"{field}: {str(folder)!r} has no *.safetensors weights; convert the checkpoint "
                               "with `save_pretrained(..., safe_serialization=True)`")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        for name in sorted(set(weight_map.values())):
            if not (folder / name).is_file():
                raise ModelFolderError(f"{index} names {name}, which is not in {folder}: copy every shard")
    for shard in shards:
        check_safetensors(shard)


def check_safetensors(file: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header, then exactly the bytes the header maps:
    reading the header finds a truncated or padded file before a loader fails on it without its name."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFolderError(f"{file}: {size} bytes, too short for a safetensors file; copy it again")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ModelFolderError(f"{file}: truncated: its header alone says {8 + header_len} bytes, the file has "
                                   f"{size}; copy it again (or it is not a safetensors file)")
        try:
            header = json.loads(f.read(header_len))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ModelFolderError(f"{file}: the header is not valid JSON mapping tensors to data_offsets: not a "
                                   "safetensors file, or damaged; copy it again") from None
    expected = 8 + header_len + end
    if size < expected:
        raise ModelFolderError(f"{file}: truncated: its header says {expected} bytes, the file has {size}; "
                               "copy it again")
    if size > expected:
        raise ModelFolderError(f"{file}: {size - expected} bytes past the {expected} its header says: damaged; "
                               "copy it again")


# What transformers builds a tokenizer from: its own serialization, or a slow tokenizer's vocabulary files that
# it converts (byte-level BPE, SentencePiece, WordPiece, tiktoken). Without any of them it builds an empty one.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json + merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.txt", "*.tiktoken")


def check_tokenizer_files(folder: Path, field: str = "model.path") -> None:
    if any(all(any(folder.glob(name)) for name in alt.split(" + ")) for alt in TOKENIZER_FILES):
        return
    found = sorted(f.name for f in folder.iterdir()) if folder.is_dir() else []
    listing = ", ".join(found[:12]) + (", ..." if len(found) > 12 else "")
    raise ModelFolderError(f"{field}: {str(folder)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} "
                           f"is there (found: {listing or 'nothing'}); save it beside the weights "
                           "(`tokenizer.save_pretrained(folder)`) or copy its files from the base model's folder")


def check_same_tokenizer(model_path: str, other: str, field: str, trust_remote_code: bool = False) -> None:
    """Refuse a second model (a teacher) whose tokenizer maps any token to another id than the policy's: its
    logprobs of the policy's token ids would be of other tokens, and nothing downstream could tell."""
    ours, theirs = (load_tokenizer(p, trust_remote_code).get_vocab() for p in (model_path, other))
    differ = sorted({t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t)})
    if differ:
        shown = ", ".join(f"{t!r} ({ours.get(t)} vs {theirs.get(t)})" for t in differ[:3])
        raise ModelFolderError(
            f"{field}: {other!r} has another tokenizer than model.path {model_path!r} ({len(ours)} vs {len(theirs)} "
            f"tokens; {len(differ)} map to different ids or to none, e.g. {shown}): its logprobs "
            "would be of other tokens than the policy samples; use a model sharing the policy's tokenizer (the "
            "same family and vocabulary)")


def read_json(file: Path) -> Any:
    """A model folder's JSON file, or an error naming it and where it breaks."""
    try:
        return json.loads(file.read_bytes())
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{file}: not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); "
                               "copy it again from the model's source") from None
    except UnicodeDecodeError as exc:
        raise ModelFolderError(f"{file}: not UTF-8 text (byte offset {exc.start}); copy it again") from None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load the folder's tokenizer. A bare `tokenizer.json` loads as PreTrainedTokenizerFast, unchanged."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    check_tokenizer_files(p)
    cfg = read_json(p / "tokenizer_config.json") if (p / "tokenizer_config.json").is_file() else {}
    declared = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    try:
        # transformers 5 may pick a tokenizer class from the *model* type and re-split text; a folder that says
        # PreTrainedTokenizerFast (as tandem's own do) is loaded as exactly that.
        if declared in ("PreTrainedTokenizerFast", "TokenizersBackend") or (
                declared is None and (p / "tokenizer.json").is_file()):
            tok = PreTrainedTokenizerFast.from_pretrained(str(p))
        else:
            tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers' and tokenizers' own messages seldom say which folder
        raise ModelFolderError(f"model.path: the tokenizer in {p} does not load: {exc}") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def takes_images(config: dict) -> bool:
    """Whether a config.json (as a dict) is a vision-language model's (it has a vision_config): it loads as an
    image-text-to-text model, with a processor for its images. tandem.architectures' profile records the answer for
    everything above this layer; the loaders here ask the config they load."""
    return "vision_config" in config


def _auto_class(path: str | Path):
    """The transformers auto class that loads the checkpoint (`takes_images`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if takes_images(read_json(Path(path) / "config.json")) else AutoModelForCausalLM


def load_processor(path: str | Path, trust_remote_code: bool = False):
    """A vision-language model's processor (its image processor and tokenizer), from its folder.

    Every video processor of transformers 5 needs torchvision, of which no CPU build for this torch exists: where it is
    missing, a processor with a video processor (Qwen-VL's: AutoProcessor fails with "Qwen2VLVideoProcessor requires
    the Torchvision library") loads without one. tandem's prompts hold images, never videos; transformers then picks
    its family's PIL image processor itself (`Qwen2VLImageProcessorPil`)."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        family = _processor_class(path, trust_remote_code)
        if family is not None and "video_processor" in family.get_attributes():
            return _without_video(family).from_pretrained(str(path))
    return AutoProcessor.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def _processor_class(path: str | Path, trust_remote_code: bool) -> type | None:
    """The processor class transformers maps the checkpoint's config to (None: no config.json, no such class, or
    remote code)."""
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    if not (Path(path) / "config.json").is_file():
        return None
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return PROCESSOR_MAPPING[type(config)] if type(config) in PROCESSOR_MAPPING else None


def _without_video(cls: type) -> type:
    """`cls` with no video processor: transformers loads, checks and pairs a processor's parts by the names
    `get_attributes` gives, which here leave `video_processor` out (its __init__ then takes its default, None). Same
    name, so what it saves names `cls`."""
    parts = cls.get_attributes()
    if parts[-1] != "video_processor":  # the parts it is given are paired with these names by position
        raise NotImplementedError(f"{cls.__name__}: its video processor needs torchvision, which is not installed, "
                                  f"and it is not its last part ({', '.join(parts)}); install torchvision")
    images_only = classmethod(lambda _: parts[:-1])
    return type(cls.__name__, (cls,), {"get_attributes": images_only, "__module__": cls.__module__})


def load_causal_lm(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False):
    """The model that writes the completions: a causal LM, or a vision-language model (`takes_images`) as its
    image-text-to-text class, which takes the images' tensors beside the ids."""
    from transformers.utils import logging as hf_logging

    check_model_files(Path(path))  # transformers' own errors about these files seldom name the file
    hf_logging.disable_progress_bar()  # one bar per load drowns the run's own progress

    model = _auto_class(path).from_pretrained(
        str(path), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
        attn_implementation=_attention(path, trust_remote_code),
    )
    return model


def load_sequence_classifier(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False):
    """A sequence-classification checkpoint (a reward model: tandem.train.reward_model checks it has one output)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    check_model_files(Path(path))
    hf_logging.disable_progress_bar()
    return AutoModelForSequenceClassification.from_pretrained(str(path), dtype=DTYPES[dtype],
                                                              trust_remote_code=trust_remote_code)


def _attention(path: str | Path, trust_remote_code: bool) -> str:
    """PyTorch's fused attention (sdpa) where the architecture has it; eager where it does not (gpt-oss: its
    attention sinks join the softmax, which sdpa cannot take)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # a class transformers does not map (remote code): sdpa, as always
        return "sdpa"
    return "sdpa" if cls._supports_sdpa else "eager"


def weightless_model(path: str | Path, trust_remote_code: bool = False):
    """The model in `path` built from its config.json on the meta device: its names and shapes, no memory, no
    weights read (what checks made before any model loads look at)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return _auto_class(path).from_config(config, trust_remote_code=trust_remote_code)


def rope_positions(model, ids: torch.Tensor, attention_mask: torch.Tensor, images: dict[str, torch.Tensor],
                   as_text: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The positions a 3-D rotary model (mRoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) gives left-padded rows with images
    (`images`: their tensors, as one forward takes them), as its own `get_rope_index` computes them: [3, rows,
    columns], time, height and width (an image's tokens take its grid's places; a text token one more than the
    greatest before it, in all three; padding 0), and each row's delta [rows]: text after the row continues at its
    1-D position plus the delta, in all three. `as_text` [rows, columns]: image tokens that are text (one a model
    sampled: its sampler fed it as a token). None for a model with 1-D positions, or rows without images: their
    1-D positions are the model's."""
    if "image_grid_thw" not in images:
        return None
    rope_index = next((m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index")), None)
    if rope_index is None:
        return None
    image_tokens = (ids == model.config.image_token_id) & attention_mask.bool()
    if as_text is not None:
        image_tokens &= ~as_text
    positions, deltas = rope_index(ids, mm_token_type_ids=image_tokens.int(), image_grid_thw=images["image_grid_thw"],
                                   attention_mask=attention_mask)
    return positions, deltas.view(-1)


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
