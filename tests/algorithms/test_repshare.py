"""Representation sharing (Ours), FD and FL: the local objective equals a numpy transcription of the
paper's loss; the vectorised round step equals a per-client loop with a numpy float64 relay server;
communication is measured from the exchanged pytrees and matches the paper's formulas."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_ssl import config_validation as cv
from fedjax_ssl import experiment, models
from fedjax_ssl.algorithms import fd, fedavg, repshare, ssl_client
from fedjax_ssl.core.algorithm import LocalData
from fedjax_ssl.core import optim, rng
from fedjax_ssl.core import round as rd
from fedjax_ssl.data import augment
from fedjax_ssl.data.types import DataInfo, FedData
from fedjax_ssl.models import layers
from fedjax_ssl.ops import prototypes
from tests import reference
from tests.core.test_round_equivalence import (AUG, BATCH, EPOCHS, NUM_CLIENTS, _assert_tree_close,
                                          _data, _float64, _round_cfg)

NUM_CLASSES, FEATURES = 3, 5  # _data() draws labels 0..2


class TinyTanhNet(nn.Module):
  """Conv -> BatchNorm -> ReLU -> mean pool -> Dense -> Tanh: [B, 8, 8, 1] -> [B, 5]; BatchNorm so
  the train-mode / eval-mode paths of the uploads are exercised."""
  feature_dim: int = FEATURES

  @nn.compact
  def __call__(self, x, train):
    x = layers.Conv(3, 3, 1, padding=1, use_bias=False, name='conv')(x)
    x = nn.relu(layers.BatchNorm(use_running_average=not train, name='bn')(x))
    return jnp.tanh(layers.Dense(self.feature_dim, name='fc')(jnp.mean(x, axis=(1, 2))))


def _spec(aug=AUG):
  return ssl_client.ClientSpec(
      objective='supervised', model=models.Classifier(TinyTanhNet(), NUM_CLASSES),
      tx=optim.make_optimizer('adam'), aug=aug, mean=(0.5,), std=(0.3,), input_shape=(8, 8, 1),
      reset_optimizer=False)


SPEC = _spec()
ALGOS = {
    'ours': lambda: repshare.make(SPEC, num_classes=NUM_CLASSES, feature_dim=FEATURES, n_avg=3,
                                  upload_batch=7),
    'ours_literal': lambda: repshare.make(SPEC, num_classes=NUM_CLASSES, feature_dim=FEATURES,
                                          n_avg=2, reduction='sum', partner='per_class',
                                          lambda_kd=0.5, lambda_disc=2.0),
    'fd': lambda: fd.make(SPEC, num_classes=NUM_CLASSES, weight=0.7, temperature=2.0,
                          upload_batch=7),
    # The stateful twin (every client's whole state), so the loop below can start from it; the
    # stateless FedAvg with persistent Adam equals this twin (test_round_equivalence,
    # 'fedavg_supervised_adam').
    'fl': lambda: fedavg.make(SPEC, stateless=False),
}


@functools.lru_cache(maxsize=None)
def _algo(name):
  algo = ALGOS[name]()
  return algo, jax.jit(algo.local_step)


# ------------------------------------------------------------------------------------------------
# numpy references.

def _np_features(client, x_uint8, kind):
  """Eval-mode features [n, d] or logits [n, C] of one client, float64 numpy."""
  x = (np.asarray(x_uint8, np.float64) / 255.0 - 0.5) / 0.3
  variables = {'params': client['params'], 'batch_stats': client['batch_stats']}
  if kind == 'logits':
    return np.asarray(SPEC.model.apply(variables, jnp.asarray(x), train=False), np.float64)
  enc = {'params': client['params']['encoder'], 'batch_stats': client['batch_stats']['encoder']}
  return np.asarray(SPEC.model.encoder.apply(enc, jnp.asarray(x), train=False), np.float64)


def _np_class_means(f, y, n):
  means, counts = np.zeros((NUM_CLASSES, f.shape[1])), np.zeros(NUM_CLASSES)
  for c in range(NUM_CLASSES):
    rows = [i for i in range(n) if y[i] == c]
    counts[c] = len(rows)
    if rows:
      means[c] = f[rows].mean(axis=0)
  return means, counts


def _np_weighted(means, counts, skip=None):
  out = np.zeros(means.shape[1:])
  for c in range(means.shape[1]):
    users = [u for u in range(means.shape[0]) if u != skip]
    total = sum(counts[u, c] for u in users)
    if total:
      out[c] = sum(counts[u, c] * means[u, c] for u in users) / total
  return out


def _take(tree, i):
  return jax.tree_util.tree_map(lambda a: np.asarray(a)[i], tree)


def relay_reference_round(name, clients, server, data, key, round_idx, *, m, cfg):
  """One round of Ours / FD as the paper's Alg. 1 reads: Python loops, numpy float64 relay.

  Shared with the engine: the per-client begin / local_step / end (reference.train_participant),
  the key rules, `relay_partners` and the n_avg draw (tested against numpy in test_prototypes).
  """
  algo, local_step = _algo(name)
  kind = 'logits' if name == 'fd' else 'features'
  (x, y), n_all = data.padded(), np.asarray(data.n)
  server = {k: np.array(v) for k, v in server.items()}
  ids = [int(i) for i in np.asarray(rd.sample_participants(key, NUM_CLIENTS, m))]
  if round_idx == 0:  # prototypes of the untrained models (A8)
    init_key = jax.random.fold_in(rng.server_key(key), repshare.INIT_STREAM)
    for cid in range(NUM_CLIENTS):
      client = _take(clients, cid)
      server['means'][cid], server['counts'][cid] = _np_class_means(
          _np_features(client, x[cid], kind), y[cid], n_all[cid])
      if name != 'fd':
        local = LocalData(*data.client(cid), jax.random.fold_in(init_key, cid))
        server['navg'][cid] = np.asarray(algo.upload(client, None, local)['navg'])
  if name != 'fd':
    server['partners'] = np.asarray(prototypes.relay_partners(
        jax.random.fold_in(rng.server_key(key), repshare.PARTNER_STREAM), NUM_CLIENTS, NUM_CLASSES,
        per_class=name == 'ours_literal'))
    glob = _np_weighted(server['means'], server['counts'])
  lr = cfg.lr_fn(round_idx)
  new, uploads, losses = {}, {}, []
  for cid in ids:
    if name == 'fd':
      msg = {'teacher': _np_weighted(server['means'], server['counts'], skip=cid)}
    else:
      msg = {'global': glob,
             'teacher': server['navg'][server['partners'][cid], np.arange(NUM_CLASSES)]}
    client, payload, loss = reference.train_participant(
        algo, local_step, _take(clients, cid), data, key, cid, msg, lr, batch_size=BATCH,
        local_epochs=EPOCHS)
    # The upload's class means are those of the trained model over the client's own data.
    want = _np_class_means(_np_features(client, x[cid], kind), y[cid], n_all[cid])
    np.testing.assert_allclose(np.asarray(payload['means']), want[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(payload['counts']), want[1])
    new[cid], uploads[cid] = client, payload
    losses.append(loss)
  for cid in ids:  # the relay buffer keeps every client's latest upload
    for k, v in uploads[cid].items():
      server[k][cid] = np.asarray(v)

  def scatter(stacked, *per_client):
    out = np.array(stacked)
    for cid, leaf in zip(ids, per_client):
      out[cid] = leaf
    return out
  clients = jax.tree_util.tree_map(scatter, clients, *[new[c] for c in ids])
  return clients, server, float(np.mean(losses))


def _check_rounds(name, strategy, m, rounds=2):
  with jax.enable_x64(True):
    algo, local_step = _algo(name)
    data = _data()
    cfg = _round_cfg(strategy, m)
    step = rd.make_round_step(algo, cfg, NUM_CLIENTS, donate=False)
    state = _float64(rd.init_state(algo, jax.random.PRNGKey(3), NUM_CLIENTS))
    for r in range(rounds):
      key = rng.round_key(jax.random.PRNGKey(7), r)
      if name == 'fl':
        ref_clients, ref_server, ref_loss = reference.reference_round(
            algo, local_step, state.clients, state.server, data, key, r, clients_per_round=m,
            batch_size=BATCH, local_epochs=EPOCHS, lr_fn=cfg.lr_fn)
      else:
        ref_clients, ref_server, ref_loss = relay_reference_round(
            name, state.clients, state.server, data, key, r, m=m, cfg=cfg)
      state, metrics = step(state, data, key)
      _assert_tree_close(state.clients, ref_clients, f'{name}/{strategy} round {r} clients')
      _assert_tree_close(state.server, _float64(ref_server), f'{name}/{strategy} round {r} server')
      np.testing.assert_allclose(float(metrics['loss']), ref_loss, rtol=1e-6)
  return state


@pytest.mark.slow
@pytest.mark.parametrize('name,strategy,m', [
    ('ours', 'vmap', 4), ('ours_literal', 'map', 3), ('fd', 'vmap', 4), ('fl', 'vmap', 4)])
def test_round_step_equals_per_client_loop(name, strategy, m):
  state = _check_rounds(name, strategy, m)
  if name != 'fl':  # the relay buffer holds real, distinct per-client prototypes
    means = np.asarray(state.server['means'])
    assert np.all(np.isfinite(means)) and np.ptp(means, axis=0).max() > 1e-3


# ------------------------------------------------------------------------------------------------
# The local objective.

def _np_objective(reduction, lambda_kd, lambda_disc, s, z, y, glob, teacher_logits):
  """Eq. 6 with the code's (mean) or the paper's (sum) reductions, float64."""
  p = np.exp(z - z.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
  ce = -np.mean(np.log(p[np.arange(len(y)), y]))
  q = np.exp(teacher_logits - teacher_logits.max(1, keepdims=True)); q /= q.sum(1, keepdims=True)
  h = p @ q.T
  t = np.eye(NUM_CLASSES)[y]
  bce = -(t * np.maximum(np.log(h), -100) + (1 - t) * np.maximum(np.log(1 - h), -100))
  sq = (s - glob[y]) ** 2
  if reduction == 'mean':
    kd, disc = sq.mean(), bce.mean()
  else:
    kd, disc = sq.sum(1).mean(), bce.sum(1).mean()
  return ce + lambda_kd * kd + lambda_disc * disc


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_local_loss_is_the_papers_objective(reduction):
  with jax.enable_x64(True):
    spec = _spec(aug=augment.preset('none', None))
    algo = repshare.make(spec, num_classes=NUM_CLASSES, feature_dim=FEATURES, reduction=reduction,
                         lambda_kd=3.0, lambda_disc=0.7)
    client = _float64(ssl_client.init_client(spec, jax.random.PRNGKey(0)))
    data = _data()
    batch = {'x': data.x[:6], 'y': data.y[:6]}
    rs = np.random.RandomState(2)
    msg = {'global': rs.uniform(-1, 1, (NUM_CLASSES, FEATURES)),
           'teacher': rs.uniform(-1, 1, (NUM_CLASSES, FEATURES))}
    _, loss = algo.local_step(client, batch, jax.random.PRNGKey(1), msg, 1e-3)
    x = (np.asarray(batch['x'], np.float64) / 255.0 - 0.5) / 0.3
    enc = {'params': client['params']['encoder'], 'batch_stats': client['batch_stats']['encoder']}
    s, _ = SPEC.model.encoder.apply(enc, jnp.asarray(x), train=True, mutable=['batch_stats'])
    s = np.asarray(s)
    w, b = (np.asarray(client['params']['head'][k]) for k in ('kernel', 'bias'))
    want = _np_objective(reduction, 3.0, 0.7, s, s @ w + b, np.asarray(batch['y']),
                         msg['global'], msg['teacher'] @ w + b)
    # The training inputs are float32 (the augmentation's output; 2^-24 relative rounding), the
    # rest float64: agreement to ~1e-7, against >= 1e-3 for any change of a term or weight.
    assert float(loss) == pytest.approx(want, rel=1e-6)
    wrong = _np_objective(reduction, 3.0, 0.7 * 1.01, s, s @ w + b, np.asarray(batch['y']),
                          msg['global'], msg['teacher'] @ w + b)
    assert float(loss) != pytest.approx(wrong, rel=1e-6)
    # The classifier gets gradients through the teacher branch too (A17): zero KD / CE weights
    # and a batch-independent teacher still move the head.
    only_disc = repshare.make(spec, num_classes=NUM_CLASSES, feature_dim=FEATURES,
                              lambda_kd=0.0, lambda_disc=1.0)
    moved, _ = only_disc.local_step(client, batch, jax.random.PRNGKey(1), msg, 1e-3)
    assert np.abs(np.asarray(moved['params']['head']['kernel'] -
                             client['params']['head']['kernel'])).max() > 1e-5


def test_fd_distillation_loss_matches_numpy():
  rs = np.random.RandomState(0)
  z, t = rs.randn(4, 3), rs.randn(4, 3)
  temp = 2.0
  p = np.exp(t / temp) / np.exp(t / temp).sum(1, keepdims=True)
  logq = z / temp - np.log(np.exp(z / temp).sum(1, keepdims=True))
  want = temp ** 2 * np.mean(-(p * logq).sum(1))
  with jax.enable_x64(True):
    assert float(fd.distillation_loss(jnp.asarray(z), jnp.asarray(t), temp)) == pytest.approx(
        want, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# Communication.

def _bytes(name):
  algo, _ = _algo(name)
  state = rd.init_state(algo, jax.random.PRNGKey(0), NUM_CLIENTS)
  cfg = _round_cfg('vmap', 4)
  return algo, cfg, state, rd.message_bytes(algo, cfg, NUM_CLIENTS, state, _data())[0]


def test_communication_matches_the_formulas():
  c, d = NUM_CLASSES, FEATURES
  # Ours: (M_up + 1) C d' floats up (full means + one n_avg-prototype per class) and the class
  # counts of the sample-weighted global mean; (M_down + 1) C d' down.
  _, _, _, ours = _bytes('ours')
  assert ours == (4 * (2 * c * d + c), 4 * 2 * c * d)
  # FD: per-class mean logits C x C (+ counts) up, the other clients' C x C down.
  _, _, _, fd_bytes = _bytes('fd')
  assert fd_bytes == (4 * (c * c + c), 4 * c * c)
  # FL: the whole model (parameters and BN statistics) both ways.
  algo, cfg, state, fl = _bytes('fl')
  model = fedavg.shared_subset(SPEC, _take(state.clients, 0))
  size = sum(np.asarray(a).size for a in jax.tree_util.tree_leaves(model))
  assert fl == (4 * size, 4 * size)
  # The round's metrics: m participants times the per-participant figures (the same code path for
  # every plain algorithm; FedSC's extra uploads are tested in test_fedsc.py).
  # Round 0 adds every client's summary of its untrained model, uploaded inside `prepare` (A8).
  algo, cfg, state, _ = _bytes('ours')
  step = rd.make_round_step(algo, cfg, NUM_CLIENTS)
  for r, extra in enumerate((NUM_CLIENTS, 0)):
    state, metrics = step(state, _data(), jax.random.PRNGKey(5 + r))
    assert float(metrics['bytes_up']) == (4 + extra) * ours.up
    assert float(metrics['bytes_down']) == 4 * ours.down


@pytest.mark.parametrize('encoder,image,params,bn_channels,ratio', [
    ('resnet9', (28, 28, 1), 2_470_730, 1_472, 963),
    ('resnet18_repshare', (32, 32, 3), 11_302_730, 4_800, 2205)])
def test_paper_ratio_to_fedavg(encoder, image, params, bn_channels, ratio):
  """FL's upload over Ours' for the paper's models (§5: ~1000x ResNet-9, ~2000x ResNet-18), from
  shapes only (nothing is computed). FL sends the D parameters and the BN running mean and variance;
  Ours 2 C d' floats and C counts. The paper's D / (2 C d') is 965 and 2208."""
  def spec_of():
    return ssl_client.ClientSpec(
        objective='supervised', model=models.Classifier(models.get_encoder(encoder), 10),
        tx=optim.make_optimizer('adam'), aug=augment.preset('none', None), mean=(0.5,) * image[2],
        std=(0.3,) * image[2], input_shape=image, reset_optimizer=False)
  spec = spec_of()
  fed = FedData(x=jax.ShapeDtypeStruct((40,) + image, jnp.uint8),
                y=jax.ShapeDtypeStruct((40,), jnp.int32), n=jax.ShapeDtypeStruct((2,), jnp.int32),
                offsets=jax.ShapeDtypeStruct((2,), jnp.int32), n_max=20)
  cfg = rd.RoundConfig(clients_per_round=2, local_epochs=1, batch_size=16,
                       lr_fn=lambda r: jnp.float32(1e-3))
  out = {}
  for name, algo in (('fl', fedavg.make(spec)),
                     ('ours', repshare.make(spec, num_classes=10,
                                            feature_dim=models.feature_dim(encoder)))):
    state = jax.eval_shape(lambda k, a=algo: rd.init_state(a, k, 2), jax.random.PRNGKey(0))
    out[name] = rd.message_bytes(algo, cfg, 2, state, fed)[0]
  d = models.feature_dim(encoder)
  assert out['fl'].up == 4 * (params + 2 * bn_channels)
  assert out['ours'] == (4 * (2 * 10 * d + 10), 4 * 2 * 10 * d)
  assert round(out['fl'].up / out['ours'].up) == ratio


# ------------------------------------------------------------------------------------------------
# Configuration.

def _config(**kw):
  c = experiment.default_config()
  c.dataset, c.encoder, c.ssl_method, c.algorithm = 'fashion_mnist_subset', 'lenet5', 'supervised', 'repshare'
  c.augmentation, c.num_clients, c.clients_per_round, c.partition = 'none', 3, 3, 'iid'
  for k, v in kw.items():
    if '.' in k:
      sub, key = k.split('.')
      c[sub][key] = v
    else:
      c[k] = v
  return c


@pytest.mark.parametrize('overrides,match', [
    (dict(ssl_method='byol'), "ssl_method = 'byol' is invalid for algorithm 'repshare'"),
    (dict(algorithm='fd', ssl_method='simclr'), "ssl_method = 'simclr' is invalid for algorithm 'fd'"),
    (dict(num_clients=1, clients_per_round=1), 'num_clients = 1 is invalid'),
    ({'hetero_ssfl.mix': 'lenet5:3'}, "only algorithm 'hetero_ssfl' reads it"),
    ({'repshare.reduction': 'max'}, 'repshare.reduction'),
    ({'repshare.partner': 'all'}, 'repshare.partner'),
    ({'repshare.n_avg': 0}, 'repshare.n_avg'),
    ({'repshare.init_prototypes': 'zeros'}, 'repshare.init_prototypes'),
    ({'algorithm': 'fd', 'fd.temperature': 0.0}, 'fd.temperature'),
])
def test_config_errors(overrides, match):
  with pytest.raises(cv.ConfigError, match=match):
    experiment.validate_config(_config(**overrides))


def test_valid_config_builds():
  config = _config()
  experiment.validate_config(config)
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  assert algo.name == 'repshare' and algo.classifier_apply is not None


def test_evaluate_reports_each_clients_test_accuracy():
  """`test_acc` is each personal classifier's accuracy on the whole test split (numpy argmax of
  the model's logits), with the client mean, list and std."""
  config = _config(knn_k=0, probe='adam', probe_epochs=0)
  dataset = experiment.load_data(config)
  algo = experiment.build_algorithm(config, dataset)
  state = rd.init_state(algo, jax.random.PRNGKey(0), 3)
  # Untrained classifiers all predict one class (10 % each); large random heads make them differ.
  head = state.clients['params']['head']
  kernel = np.random.RandomState(0).normal(0, 30, head['kernel'].shape).astype(np.float32)
  state = state.replace(clients=dict(state.clients, params=dict(
      state.clients['params'], head=dict(head, kernel=jnp.asarray(kernel)))))
  out = experiment.evaluate(config, algo, state, dataset)
  assert set(out) == {'test_acc', 'test_acc_client_std', 'test_acc_clients'}
  model = ssl_client.spec_from_config(config, DataInfo.of(dataset)).model
  x = (dataset.test_x.astype(np.float32) / 255 - dataset.mean[0]) / dataset.std[0]
  accs = []
  for c in range(3):
    v = {'params': _take(state.clients['params'], c),
         'batch_stats': _take(state.clients['batch_stats'], c)}
    logits = np.asarray(model.apply(v, jnp.asarray(x), train=False))
    accs.append(np.mean(logits.argmax(-1) == dataset.test_y))
  # The clients differ, so a mix-up of clients would show.
  assert len(set(accs)) >= 2
  np.testing.assert_allclose(out['test_acc_clients'], accs, atol=1.5 / len(dataset.test_y))
  assert out['test_acc'] == pytest.approx(np.mean(out['test_acc_clients']), rel=1e-12)
  assert out['test_acc_client_std'] == pytest.approx(np.std(out['test_acc_clients']), rel=1e-12)
