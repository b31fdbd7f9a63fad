"""The federated engine: stacked client state, one jitted round step, execution strategies."""
from fedjax_ssl.core.rng import client_key, round_key  # noqa: F401
from fedjax_ssl.core.round import (RoundConfig, init_state, make_round_step,  # noqa: F401
                                   make_sequential_round_step, sample_participants)
from fedjax_ssl.core.state import FedState  # noqa: F401
