"""The federated engine: the Algorithm contract, stacked client state, one jitted round step,
execution strategies. Imports nothing from the layers above it (algorithms, data sources, models)."""
from fedjax_ssl.core.algorithm import (Algorithm, Cohort, CohortSlots, LocalData, Prepare,  # noqa: F401
                                       Stateless, replicate, weighted_mean)
from fedjax_ssl.core.rng import client_key, round_key  # noqa: F401
from fedjax_ssl.core.round import (RoundConfig, init_state, make_round_step,  # noqa: F401
                                   sample_participants)
from fedjax_ssl.core.state import FedState  # noqa: F401
