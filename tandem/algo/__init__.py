"""Advantages, policy losses, KL estimators and loss aggregation: pure tensor functions, registered by name."""
from tandem.algo.core import (  # noqa: F401
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossParams,
    entropy_from_logits,
    masked_mean,
)
