"""Key derivation. Every random draw of a round is a pure function of (round key, client id, step),
so results never depend on execution order, strategy or which other clients take part."""
from __future__ import annotations

from typing import Tuple

import jax

# Distinct fold-in tags keep the streams of one client independent of each other.
_PERMUTATION_STREAM = 0
_STEP_STREAM = 1
_BEGIN_STREAM = 2
_UPLOAD_STREAM = 3


def round_key(root_key: jax.Array, round_idx) -> jax.Array:
  """Key of round `round_idx` (int or int32 scalar) derived from the run's root key."""
  return jax.random.fold_in(root_key, round_idx)


# Client ids are < 2**32 - 1, so the participant draw never shares a stream with a client.
_SAMPLING_TAG = 0xFFFFFFFF


def sampling_key(rkey: jax.Array) -> jax.Array:
  """Key used to choose the round's participants."""
  return jax.random.fold_in(rkey, _SAMPLING_TAG)


# The server's own draws of a round (e.g. relay partners) use a tag no client id reaches either.
_SERVER_TAG = 0xFFFFFFFE


def server_key(rkey: jax.Array) -> jax.Array:
  """Key of the server's draws in this round (independent of every client's stream)."""
  return jax.random.fold_in(rkey, _SERVER_TAG)


def client_key(rkey: jax.Array, client_id) -> jax.Array:
  """Key of client `client_id` in this round: fold_in(round_key, client_id) (the design's rule)."""
  return jax.random.fold_in(rkey, client_id)


def epoch_permutation_key(ckey: jax.Array, epoch) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(ckey, _PERMUTATION_STREAM), epoch)


def step_key(ckey: jax.Array, step) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(ckey, _STEP_STREAM), step)


def begin_key(ckey: jax.Array) -> jax.Array:
  return jax.random.fold_in(ckey, _BEGIN_STREAM)


def upload_key(ckey: jax.Array) -> jax.Array:
  """Key of a participant's upload (e.g. which samples make its n_avg-prototypes)."""
  return jax.random.fold_in(ckey, _UPLOAD_STREAM)


def run_keys(seed: int) -> Tuple[jax.Array, jax.Array]:
  """(init_key, run_key) of a run: the model init and every round's randomness (round r uses
  round_key(run_key, r))."""
  init_key, run_key = jax.random.split(jax.random.PRNGKey(seed))
  return init_key, run_key
