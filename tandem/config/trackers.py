"""The experiment trackers `run.report_to` may name and what each needs installed, found without importing it: the
config's check stays light, and tandem.run.trackers, which drives them, reads the same table."""
from __future__ import annotations

import importlib.util
import os
from urllib.parse import urlparse

# name -> (the module it needs, where it stores a run under run.output_dir when the environment names no server)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
    "swanlab": ("swanlab", "swanlog"),
}
# What a tracker's store needs beyond its module: MLflow's local one is a SQLite database (what MLflow recommends
# locally; its file store is in maintenance mode), which it reaches through SQLAlchemy and migrates with Alembic,
# neither of which mlflow-skinny installs (nor does a database URI of one's own do without them).
LOCAL_STORE_NEEDS: dict[str, tuple[str, ...]] = {"mlflow": ("sqlalchemy", "alembic")}


def missing(names: list[str]) -> list[str]:
    """Trackers among `names` whose library is not installed (or, for a local store, what that store needs)."""
    return [n for n in names if any(importlib.util.find_spec(m) is None for m in _needs(n))]


def _needs(name: str) -> tuple[str, ...]:
    """The modules `name` needs here: its library's, and for MLflow on a SQL store (its local default, or a
    database URI) SQLAlchemy's and Alembic's."""
    sql = name == "mlflow" and sql_store(os.environ.get("MLFLOW_TRACKING_URI") or "sqlite://")
    return (TRACKERS[name][0], *(LOCAL_STORE_NEEDS.get(name, ()) if sql else ()))


SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQL stores (mlflow.store.db.db_types)


def sql_store(uri: str) -> bool:
    """Whether MLflow keeps `uri`'s runs in one of its SQL stores (`sqlite:///...`, `postgresql+psycopg2://...`)."""
    return urlparse(uri).scheme.split("+")[0] in SQL_SCHEMES
