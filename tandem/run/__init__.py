"""A run's life on disk and in time: its directory and lock, checkpoints, stop signals, metrics, evaluation, and the
rollout source that feeds its steps."""
