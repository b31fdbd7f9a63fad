"""The divided evaluation (run_setup.TrainFeatures): each process embeds the training rows it
holds and one gather assembles the split; equal to embedding the whole split, bit for bit."""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_ssl import evaluation
from fedjax_ssl.core import placement
from fedjax_ssl.data import partition, sources
from fedjax_ssl.runs import run_setup


def _encoder():
  """A stand-in Algorithm: a fixed random projection of the normalised pixels through tanh."""
  w = jax.random.normal(jax.random.PRNGKey(0), (8 * 8 * 1, 5)) / 8.0
  return types.SimpleNamespace(encoder_apply=lambda v, x: jnp.tanh(x.reshape(len(x), -1) @ v)), w


def test_features_from_the_held_rows_equal_the_whole_splits_and_keep_no_images():
  dataset = sources.make_synthetic(num_train=90, num_test=10, image_shape=(8, 8, 1))
  # A public set (held by every process) and a skewed partition, so that the clients' rows are
  # not the split's order.
  fed, info = partition.build_fed_data(dataset, 6, 'dirichlet', seed=1, alpha=0.3,
                                       public_size=7, on_host=True)
  algo, w = _encoder()
  want = np.asarray(evaluation.encoder_features(algo, w, False, dataset.train_x, dataset))
  features = run_setup.TrainFeatures.build(placement.divide(fed, 0, 1), dataset, info)
  assert features.dataset.train_x.shape == (0, 8, 8, 1) and features.dataset.train_x.base is None
  got = features(algo, w)
  assert got.shape == (90, 5) and len(features.dataset.train_y) == 90
  np.testing.assert_array_equal(got, want)


def test_a_split_the_clients_do_not_cover_keeps_every_process_embedding_it():
  dataset = sources.make_synthetic(num_train=60, num_test=10, image_shape=(8, 8, 1))
  fed, info = partition.build_fed_data(dataset, 3, 'iid', seed=0, on_host=True)
  local = placement.divide(fed, 0, 1)
  assert run_setup.TrainFeatures.build(local, dataset, info) is not None
  missing = dict(info, indices=[i[1:] for i in info['indices']])   # a row of each client dropped
  assert run_setup.TrainFeatures.build(local, dataset, missing) is None
  unlabelled = dataclasses.replace(dataset, unlabeled_x=dataset.train_x)
  assert run_setup.TrainFeatures.build(local, unlabelled, info) is None
