"""The README's config reference is the one the code generates, so the docs never drift from the defaults."""
from pathlib import Path

from tandem.config import config_reference

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def test_readme_config_reference_is_current():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    current = readme.split(START)[1].split(END)[0].strip()
    assert current == config_reference().strip(), "regenerate: paste `tandem config --doc` between the markers"


def test_every_field_is_documented():
    for line in config_reference().splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), line
