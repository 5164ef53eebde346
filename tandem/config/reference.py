"""The config reference, generated from each field's default and description (`tandem config --doc`,
scripts/gen_docs.py)."""
from __future__ import annotations

from pydantic import BaseModel

from tandem.config.schema import Config


def config_reference() -> str:
    """Markdown reference of every field with its default and documentation (for the README)."""
    out = []
    for section, field in Config.model_fields.items():
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        model = inner[0] if inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel) else ann
        out.append(f"### `{section}`\n")
        if field.description:
            out.append(field.description + "\n")
        if model is not ann:  # a list of entries: show the default list, then each entry's keys
            entries = [e.model_dump() for e in field.default_factory()]
            out.append(f"Default: `{entries!r}`. Each entry:\n")
        out.append("| key | default | meaning |\n|---|---|---|")
        out += _rows(section, model)
        out.append("")
    return "\n".join(out)


def _rows(prefix: str, model: type[BaseModel]) -> list[str]:
    """A table row per field of `model`; a field that is itself a section (algo.distill) is followed by its own."""
    rows = []
    for name, f in model.model_fields.items():
        if f.is_required():
            shown = "required"
        else:
            default = f.default_factory() if f.default_factory else f.default
            shown = f"`{(default.model_dump() if isinstance(default, BaseModel) else default)!r}`"
        rows.append(f"| `{prefix}.{name}` | {shown} | {f.description or ''} |")
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            rows += _rows(f"{prefix}.{name}", f.annotation)
    return rows
