"""Writes the documentation's generated blocks from the code: the config, CLI, architecture and metrics references, the
README's zoo.

    .venv/bin/python scripts/gen_docs.py

Each block sits between `<!-- NAME:start -->` and `<!-- NAME:end -->` in its file; everything outside the markers is
written by hand and left alone. tests/core/test_docs.py fails when a block is not what this script would write.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.architectures import SUPPORT, support_table  # noqa: E402
from tandem.cli import build_parser  # noqa: E402
from tandem.config import config_reference  # noqa: E402
from tandem.run.metric_names import GROUPS, PLACEHOLDERS  # noqa: E402

COMMAND = ".venv/bin/python scripts/gen_docs.py"


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    name: str  # the markers' name
    render: Callable[[], str]

    @property
    def markers(self) -> tuple[str, str]:
        return f"<!-- {self.name}:start -->", f"<!-- {self.name}:end -->"


def markdown_text(text: str) -> str:
    """Text outside code spans made safe for a Markdown table cell: a `|` would end the cell, a `<name>` would be
    read as an HTML tag and vanish."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|").replace("<", "&lt;") for p in parts)


_FIELD_ROW = re.compile(r"^(\| `[^`]+` \| (?:required|`.*?`) \| )(.*)( \|)$")


def config_block() -> str:
    """`tandem config --doc`, each field's meaning made safe for a Markdown table cell."""
    lines = []
    for line in config_reference().strip().splitlines():
        row = _FIELD_ROW.match(line)
        lines.append(row[1] + markdown_text(row[2]) + row[3] if row else line)
    return "\n".join(lines)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=10_000)  # one line, whatever the terminal's width
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`" + (" (any number)" if action.nargs == "*" else " (optional)" if action.nargs == "?"
                                      else "")
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
    return flags + (f" `{action.metavar or action.dest.upper()}`" if action.nargs != 0 else "")


def cli_block() -> str:
    """Every command of `tandem` with its usage and arguments, from the parser itself (tandem.cli.build_parser)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {c.dest: c.help for c in commands._choices_actions}
    out = [f"`{_usage(parser)}`", "", "| command | what it does |", "|---|---|"]
    out += [f"| [`tandem {name}`](#tandem-{name}) | {markdown_text(summaries[name])} |" for name in commands.choices]
    for name, command in commands.choices.items():
        summary = markdown_text(summaries[name])
        out += ["", f"## `tandem {name}`", "", summary[:1].upper() + summary[1:] + ".", "", "```",
                _usage(command), "```", "", "| argument | default | meaning |", "|---|---|---|"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            default = "" if action.default in (None, False, argparse.SUPPRESS) else f"`{action.default}`"
            choices = f" One of {', '.join(f'`{c}`' for c in action.choices)}." if action.choices else ""
            out.append(f"| {_argument(action)} | {default} | {markdown_text(action.help or '')}{choices} |")
    return "\n".join(out)


def architectures_block() -> str:
    """tandem.architectures.SUPPORT: where each architecture runs, what LoRA adapts in it by default, and what its
    profile says of its parts, its experts, how its prompts run once and whether it trains padding-free."""
    once = {"kv": "its KV cache", "state": "its recurrent state", "": "no"}
    out = [support_table(), "", "| `model_type` | LoRA's default modules | LoRA's default parameters | "
           "mixture of experts (config.json's count) | prompts run once in the trainer | padding-free "
           "(`batch.padding_free`) | language model, layers |",
           "|---|---|---|---|---|---|---|"]
    for kind, s in SUPPORT.items():
        parameters = ", ".join(f"`{p}`" for p in s.lora_parameters) or (
            f"none (experts refused: {s.no_expert_lora})" if s.no_expert_lora else "none")
        experts = f"yes ({', '.join(f'`{k}`' for k in s.expert_keys)})" if s.experts else "no"
        packs = f"no, padded: {markdown_text(s.no_packing)}" if s.no_packing else "yes"
        out.append(f"| `{kind}` | {', '.join(f'`{m}`' for m in s.lora)} | {parameters} | {experts} | "
                   f"{once[s.prompts_once]} | {packs} | `{s.language_model}`, `{s.decoder_layers}` |")
    return "\n".join(out)


def metrics_block() -> str:
    """tandem.run.metric_names: the placeholders, then each group's metrics with their unit, writers and meaning."""
    out = ["| placeholder | stands for |", "|---|---|"]
    out += [f"| `<{name}>` | {markdown_text(meaning)} |" for name, (_, meaning) in PLACEHOLDERS.items()]
    for title, (about, metrics) in GROUPS.items():
        out += ["", f"## {title}", "", markdown_text(about), "", "| metric | unit | written by | meaning |",
                "|---|---|---|---|"]
        out += [f"| `{m.name}` | {markdown_text(m.unit)} | {markdown_text(m.written)} | {markdown_text(m.meaning)} |"
                for m in metrics]
    return "\n".join(out)


BLOCKS = (
    Block("docs/reference/config.md", "config-reference", config_block),
    Block("docs/reference/cli.md", "cli-reference", cli_block),
    Block("docs/reference/architectures.md", "architectures", architectures_block),
    Block("docs/reference/metrics.md", "metrics-reference", metrics_block),
    Block("README.md", "model-zoo", support_table),
)


def written(block: Block) -> str:
    """The block as it stands in its file, between its markers."""
    text = (ROOT / block.path).read_text()
    start, end = block.markers
    if start not in text or end not in text:
        raise SystemExit(f"{block.path}: no {start} ... {end} markers; put them where the block goes")
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def write(block: Block) -> bool:
    """Replace the block between its markers with the code's; True when that changed the file."""
    path = ROOT / block.path
    text = path.read_text()
    start, end = block.markers
    if written(block) == block.render().strip():
        return False
    head, rest = text.split(start, 1)
    path.write_text(f"{head}{start}\n{block.render().strip()}\n{end}{rest.split(end, 1)[1]}")
    return True


def main() -> int:
    for block in BLOCKS:
        print(f"{block.path} ({block.name}): {'rewritten' if write(block) else 'current'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
