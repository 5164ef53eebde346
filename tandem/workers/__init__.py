"""Worker roles and worker groups: the controller calls a group the same way whatever its backend."""
from tandem.workers.group import LocalWorkerGroup, WorkerContext, WorkerError, WorkerGroup  # noqa: F401
