"""One typed config for a run: YAML plus dotted overrides, validated in full before any model loads.

pydantic v2 rather than dataclasses: it checks types and ranges per field with the field's path in the error,
refuses unknown keys (`extra="forbid"`), and keeps each field's documentation next to its default, from which
the config reference is generated (`tandem config --doc`).

The package by concern: the sections, each field documented where it is defined (`run.py`: run, model, data;
`rollout.py`: rollout, env; `algo.py`: batch, algo, optim, lora; `scoring.py`: rewards, reward_pool, eval;
`placement.py`), the whole config and its cross-field checks (`schema.py`), other frameworks' names
(`aliases.py`), the loader (`loader.py`), the generated reference (`reference.py`). Checking a config imports nothing
heavy (no torch, no model library): what a check needs to know of the rest of tandem is stated here (`trackers.py`,
`algo.REGISTERED`), and the import contract (pyproject.toml) keeps it so.
"""
from tandem.config.algo import AlgoConfig, BatchConfig, LoraConfig, OldLogprobs, OptimConfig  # noqa: F401
from tandem.config.aliases import KNOWN_ALIASES  # noqa: F401
from tandem.config.base import ConfigError, Section  # noqa: F401
from tandem.config.loader import apply_overrides, load_config  # noqa: F401
from tandem.config.placement import PlacementConfig  # noqa: F401
from tandem.config.reference import config_reference  # noqa: F401
from tandem.config.rollout import EnvConfig, RolloutConfig, VLLMConfig  # noqa: F401
from tandem.config.run import DataConfig, ModelConfig, RunConfig  # noqa: F401
from tandem.config.schema import Config  # noqa: F401
from tandem.config.scoring import EvalConfig, RewardPoolConfig, RewardSpec  # noqa: F401
