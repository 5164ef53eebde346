"""The config's copy of the registered names (it checks a config without importing torch) is the registries'."""
from typing import get_args

from tandem.algo import ADVANTAGES, AGGREGATIONS, IS_MASKS, KL_ESTIMATORS, POLICY_LOSSES
from tandem.config import AlgoConfig
from tandem.config.algo import GROUP_BASELINES, REGISTERED


def test_the_configs_names_are_the_registered_ones():
    """A function registered (or renamed) in tandem.algo and not in tandem.config.algo would be refused by every
    config; one named there and registered nowhere would pass the config and fail at the first step."""
    registries = {"advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES, "loss_agg": AGGREGATIONS,
                  "kl_estimator": KL_ESTIMATORS}
    assert {field: sorted(names) for field, names in REGISTERED.items()} == \
        {field: sorted(table) for field, table in registries.items()}
    assert sorted(GROUP_BASELINES) == sorted(name for name, a in ADVANTAGES.items() if a.needs_groups)
    assert set(get_args(AlgoConfig.model_fields["is_mask"].annotation)) == {"none", *IS_MASKS}
