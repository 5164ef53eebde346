"""What every section of the config shares: the error a bad config raises, the section's base class, the nearest
valid name for a misspelt one."""
from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot run. The message names the field, the bad value and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def suggest(key: str, options) -> str:
    """The hint `; did you mean 'x'?` naming the option nearest `key` (empty where none is near)."""
    near = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else ""
