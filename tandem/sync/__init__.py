"""Moving weights from the training layout to the rollout layout (in-process copy for the local worker)."""
