"""Worker roles and worker groups: the controller calls a group the same way whatever its backend."""
from tandem.workers.group import LocalWorkerGroup, WorkerGroup, WorkerError  # noqa: F401
