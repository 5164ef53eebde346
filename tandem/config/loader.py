"""Loading a config: defaults, a YAML file and dotted overrides merged and validated together, every problem named."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tandem.config.aliases import section_fields, unknown_key_hint
from tandem.config.base import ConfigError
from tandem.config.schema import Config


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: list[str] | None = None) -> Config:
    """`defaults` (dotted, e.g. a recipe's), then the YAML file, then `overrides`, validated together.

    Raises ConfigError listing every problem.
    """
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except _DuplicateKey as dup:
            raise ConfigError(f"config file {str(p)!r}: key {dup.key!r} appears twice in one mapping, at lines "
                              f"{dup.first_line} and {dup.line}; YAML would keep only the second and drop the first "
                              "one's settings silently: merge them into one") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config file {str(p)!r} is not valid YAML{where}: "
                              f"{getattr(exc, 'problem', exc)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping of sections, "
                              f"got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(_merge(apply_overrides({}, defaults or []), data), overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "config"
        if e["type"] == "extra_forbidden":
            section = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
            lines.append(f"{where}: unknown key{unknown_key_hint(str(loc[-1]), section, section_fields(loc[:-1]))}")
        elif e["type"] == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
            lines.append(str(e["ctx"]["error"]))
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. algo.kl_coef=0.01")
    key, _, raw = text.partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = _parse_override(text)
        node = data
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(keys[:i + 1])} is not a section")
            node = nxt
        node[keys[-1]] = value
    return data


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(key, first_line, line)
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently: a second
    `batch:` section would drop the first one's keys). Keys a merge (`<<: *base`) brings in may be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the constructor below reports it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKey(key, first, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep)
