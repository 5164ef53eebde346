"""Prompt sources, chat templates and the built-in verifiable tasks (importing registers their rewards)."""
from tandem.data import arithmetic  # noqa: F401  (registers arithmetic_exact, arithmetic_format)
