"""run_identity: which configs are one run, one compiled program, one step cost."""
from fedjax_ssl import experiment, run_identity


def _config(**overrides):
  c = experiment.default_config()
  c.update(overrides)
  return c


def test_run_key_ignores_unused_keys_and_the_blocks_of_other_methods():
  base = _config(partition='iid', algorithm='fedavg', ssl_method='simclr')
  same = _config(partition='iid', algorithm='fedavg', ssl_method='simclr', alpha=0.05)
  same.fedu2.lambda_u = 0.0   # another algorithm's block
  same.byol.ema_tau = 0.5     # another objective's block
  assert run_identity.run_key(same) == run_identity.run_key(base)
  for change in (dict(partition='dirichlet'), dict(lr=0.2), dict(seed=1)):
    assert run_identity.run_key(_config(**{**dict(partition='iid', algorithm='fedavg',
                                                  ssl_method='simclr'), **change})) \
        != run_identity.run_key(base), change
  other = _config(partition='iid', algorithm='fedavg', ssl_method='simclr')
  other.simclr.temperature = 0.3  # the configured objective's block is the run's
  assert run_identity.run_key(other) != run_identity.run_key(base)


def test_moved_keys_migrate_into_their_blocks():
  assert run_identity.migrate({'ema_tau': 0.9, 'byol': {'predictor_lr_scale': 1.0}, 'lr': 0.1}) \
      == {'byol': {'predictor_lr_scale': 1.0, 'ema_tau': 0.9}, 'lr': 0.1}


def test_step_cost_key_groups_runs_of_one_step_whatever_their_size():
  shape = (28, 28, 1)
  key = run_identity.step_cost_key(_config(), shape)
  for same in (dict(seed=3), dict(rounds=7), dict(lr=0.5), dict(num_clients=20, train_size=500),
               dict(alpha=5.0)):
    assert run_identity.step_cost_key(_config(**same), shape) == key, same
  for other in (dict(batch_size=64), dict(encoder='lenet5'), dict(ssl_method='simclr'),
                dict(augmentation='none')):
    assert run_identity.step_cost_key(_config(**other), shape) != key, other
  assert run_identity.step_cost_key(_config(), (32, 32, 3)) != key
  # A block's switch (a string, a bool or a weight of 0) is a variant with its own step.
  mu0 = _config(algorithm='hetero_ssfl')
  mu0.hetero_ssfl.mu = 0.0
  assert run_identity.step_cost_key(mu0, shape) != run_identity.step_cost_key(
      _config(algorithm='hetero_ssfl'), shape)
