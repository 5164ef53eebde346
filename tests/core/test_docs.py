"""The documentation's generated blocks are what the code generates, and the README stays a front door."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tandem.config import config_reference

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
gen_docs = sys.modules["gen_docs"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_docs)


@pytest.mark.parametrize("block", gen_docs.BLOCKS, ids=lambda b: f"{b.path}:{b.name}")
def test_each_generated_block_is_current(block):
    assert gen_docs.written(block) == block.render().strip(), (
        f"{block.path}'s {block.name} block is not what the code generates; regenerate: {gen_docs.COMMAND}")


def test_regenerating_rewrites_only_between_the_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    (tmp_path / "page.md").write_text("# Title\n\nby hand\n<!-- x:start -->\nold\n<!-- x:end -->\nafter\n")
    block = gen_docs.Block("page.md", "x", lambda: "| a | b |")
    assert gen_docs.write(block) and not gen_docs.write(block)
    assert (tmp_path / "page.md").read_text() == (
        "# Title\n\nby hand\n<!-- x:start -->\n| a | b |\n<!-- x:end -->\nafter\n")


def test_every_field_is_documented():
    for line in config_reference().splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), line


def test_each_config_row_keeps_its_three_columns():
    """A `|` in a field's meaning (`mean |sampler - trainer|`) would split its cell; a `<name>` would vanish as HTML."""
    rows = [line for line in gen_docs.config_block().splitlines() if line.startswith("| `")]
    assert rows
    for row in rows:
        outside_code = re.sub(r"`[^`]*`", "", row)
        assert len(re.findall(r"(?<!\\)\|", outside_code)) == 4, row
        assert "<" not in outside_code, row


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    head = readme.splitlines()[:30]
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert any(line.startswith(command) for line in head), f"README: `{command}` belongs in its first 30 lines"
    assert len(readme.splitlines()) <= 220, "README: keep it a front door; guides and references go under docs/"
    assert "../" not in readme, "README: a path outside the repository is not there for a user who cloned it"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"


def test_each_metrics_row_keeps_its_columns():
    """As the config's rows: `|trainer logprob - sampler logprob|` in a meaning must not split its cell."""
    from tandem.run.metric_names import METRICS, PLACEHOLDERS

    rows = [line for line in gen_docs.metrics_block().splitlines() if line.startswith("| `")]
    assert len(rows) == len(PLACEHOLDERS) + len(METRICS)
    for row in rows:
        outside_code = re.sub(r"`[^`]*`", "", row)
        assert len(re.findall(r"(?<!\\)\|", outside_code)) == (3 if row.startswith("| `<") else 5), row
        assert "<" not in outside_code, row
