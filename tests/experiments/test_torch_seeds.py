"""experiments/torch_seeds.py: the seed systems' PyTorch rounds compute what our JAX rounds compute.

From the same weights and the same two views (and, where the method draws random numbers, the same
draws: FUR's prior points, the RAD sub-batch) the first local step's loss and every parameter's
gradient agree with ssl_client.loss_fn of the method's client spec; the server pieces (EUA's
coefficients, DP-CalR's matrix, the Kbar aggregate, FedEMA's divergence) agree with the library's
functions; the models agree with the flax encoders. A whole round is not compared: each framework
draws its own views, priors, noise and RAD rows, so two rounds agree only in distribution (the
pieces above are what a round is made of). Skipped without torch (a benchmark-only extra).
"""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

torch = pytest.importorskip('torch')

from experiments import seed_speed, torch_seeds as ts  # noqa: E402
from fedjax_ssl import experiment, models  # noqa: E402
from fedjax_ssl.algorithms import divergence, fedu2, hetero_ssfl, ssl_client  # noqa: E402
from fedjax_ssl.data import augment  # noqa: E402
from fedjax_ssl.data.types import Dataset, DataInfo  # noqa: E402
from fedjax_ssl.ops import cka, correlation, uot  # noqa: E402

B, HW = 6, 8
HEADS = ((32, 16, True), (32, 16, True))


def _perturbed(tree, key, scale=0.05):
  """tree + scale N(0, 1) on every leaf (zero-initialised kernels and unit scales would hide a
  layout error)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = jax.random.split(key, len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      l + scale * jax.random.normal(k, jnp.shape(l)) for l, k in zip(leaves, keys)])


def _nchw(x):
  return torch.from_numpy(np.asarray(x, np.float32).transpose(0, 3, 1, 2).copy())


def _assert_tree_close(got, want, rtol, atol):
  flat_g = dict(jax.tree_util.tree_flatten_with_path(got)[0])
  for path, w in jax.tree_util.tree_flatten_with_path(want)[0]:
    np.testing.assert_allclose(flat_g[path], np.asarray(w), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('encoder,heads', [('resnet18', 'fedu2'), ('fixup_resnet20', 'fedsc')])
def test_models_match_flax(encoder, heads):
  """Train-mode forward of the torch twin equals the flax SSLModel (perturbed weights, 8x8)."""
  flax_model = models.build_ssl_model(encoder, heads, with_predictor=heads != 'fedsc')
  x = jax.random.normal(jax.random.PRNGKey(1), (4, HW, HW, 3))
  v = flax_model.init(jax.random.PRNGKey(0), x, train=False)
  params = _perturbed(v['params'], jax.random.PRNGKey(2))
  out, _ = flax_model.apply({'params': params, 'batch_stats': v.get('batch_stats', {})}, x,
                            train=True, mutable=['batch_stats'])
  t = ts.make_online(encoder, ts.HEADS[heads], HW)
  ts.load_flax(t, params, v.get('batch_stats'))
  z, p = t(_nchw(x))
  # float32 convolutions summed in another order through 20 layers; train-mode BatchNorm over 4
  # images of 1x1 pixels in the last stage divides by the spread of 4 numbers, which amplifies
  # that rounding up to ~100x: 1e-3 of the output's scale (measured: 1e-4 ResNet-18, 3e-7 Fixup).
  for got, want in ((z, out['z']), (p, out.get('p'))):
    if want is not None:
      err = np.max(np.abs(got.detach().numpy() - np.asarray(want)))
      assert err <= 1e-3 * np.max(np.abs(want)), (err, np.max(np.abs(want)))


def _tiny(method: str):
  """(config, DataInfo) of a tiny run of `method`: the MLP encoder, 32-16 heads, 8x8 images."""
  s = dataclasses.replace(ts.reduced_settings()[{'fedu2': 'fedu2_cross_silo'}.get(method, method)],
                          cohorts=(('mlp', 2),), heads=HEADS if method != 'fedsc'
                          else ((32, 16, False), None), batch=B)
  if method == 'fedsc':  # a NormClip level small enough to clip some rows of these features
    s = dataclasses.replace(s, extra=tuple(dict(s.extra, sc_mu=0.5).items()))
  c = seed_speed.jax_config(s, 'float32', 1)
  x = np.zeros((B, HW, HW, 3), np.uint8)
  ds = Dataset(name='t', train_x=x, train_y=np.zeros(B, np.int32), test_x=x,
               test_y=np.zeros(B, np.int32), num_classes=10, mean=(0.5,) * 3, std=(0.25,) * 3)
  return s, c, DataInfo.of(ds, np.array([B, B]))


def _first_step(method: str, **extra):
  """(loss, grads) of the first local step in JAX and in torch, same weights, views and draws."""
  s, c, info = _tiny(method)
  spec = ssl_client.spec_from_config(c, info)
  if method == 'fedu2':
    spec = dataclasses.replace(spec, feature_regularizer=fedu2.fur_regularizer(c.fedu2))
  key = jax.random.PRNGKey(3)
  client = ssl_client.init_client(spec, jax.random.PRNGKey(4))
  client = dict(client, params=_perturbed(client['params'], jax.random.PRNGKey(5)))
  if 'target' in client:
    client['target'] = dict(client['target'],
                            params=_perturbed(client['target']['params'], jax.random.PRNGKey(6)))
  batch = {'x': jax.random.bits(jax.random.PRNGKey(7), (B, HW, HW, 3), jnp.uint8)}
  views = ssl_client._views(spec, key, batch['x'], 2)  # what loss_fn draws from `key`
  shared, extra_loss, kw = None, None, {}
  if method == 'fedsc':
    r = jax.random.normal(jax.random.PRNGKey(8), (16, 16)) * 0.1
    shared = (jnp.float32(0.7), r @ r.T)
    kw['shared'] = (0.7, torch.from_numpy(np.asarray(shared[1]))[None])
  if method == 'fedu2':
    keys = jax.random.split(jax.random.fold_in(key, ssl_client.REGULARIZER_STREAM), 2)
    kw['priors'] = [torch.from_numpy(np.asarray(uot.sphere_prior(k, (B, 16))))[None]
                    for k in keys]
  if method == 'hetero_ssfl':
    rad_size, b_r, mu = 12, 4, 0.7
    public = jax.random.bits(jax.random.PRNGKey(9), (rad_size, HW, HW, 3), jnp.uint8)
    a = jax.random.normal(jax.random.PRNGKey(10), (3, rad_size, 5))
    kbar = cka.aggregate_kernel((a,), (jnp.full((3,), 1 / 3),))
    rows = hetero_ssfl.rad_indices(jax.random.fold_in(key, hetero_ssfl.RAD_STREAM), rad_size, b_r)
    msg = {'kbar': kbar, 'mu': mu}

    def extra_loss(params):
      rep = hetero_ssfl.rad_representations(
          spec, {'params': params, 'batch_stats': client['batch_stats']}, public[rows],
          bn_mode='train')
      return mu * hetero_ssfl.alignment_penalty(rep, msg, rows, sign='distance', centered=True)
    rad_x = augment.normalize(augment.to_float(public[rows]), spec.mean, spec.std)
    kb = np.asarray(kbar)[np.asarray(rows)][:, np.asarray(rows)]
    kw['rad'] = (_nchw(rad_x), torch.from_numpy(kb)[None], mu)

  def total(p):
    loss, _ = ssl_client.loss_fn(spec, p, client, batch, key, shared)
    return loss if extra_loss is None else loss + extra_loss(p)
  loss, grads = jax.value_and_grad(total)(client['params'])

  online = ts.make_online('mlp', s.heads, HW)
  ts.load_flax(online, client['params'], client['batch_stats'])
  target = None
  if 'target' in client:
    target = ts.target_of(online)
    ts.load_flax(target, client['target']['params'], client['target']['batch_stats'])
  t_loss = ts.client_loss(s, online, target, _nchw(views[0]), _nchw(views[1]), **kw)
  t_loss.backward()
  return float(loss), grads, float(t_loss), ts.flax_grads(online, client['params'])


@pytest.mark.parametrize('method', ts.METHODS)
def test_first_step_loss_and_gradients_match_jax(method):
  """The official-code-style client step (torch) = our client step (JAX): loss and every gradient.

  Tolerances: float32 with different summation orders (rtol 1e-5 on the loss); the gradients of
  a loss of O(1) through 5 layers agree to 1e-4 relative, 1e-6 absolute for the entries near 0.
  """
  loss, grads, t_loss, t_grads = _first_step(method)
  assert abs(t_loss - loss) <= 1e-5 * max(1.0, abs(loss)), (t_loss, loss)
  _assert_tree_close(t_grads, grads, rtol=1e-4, atol=2e-6)


def test_fur_term_is_active_and_matches():
  """FUR at the tiny size is not zero (the UOT plan is active) and equals ops.uot's value."""
  z = jax.random.normal(jax.random.PRNGKey(0), (B, 16))
  s = uot.sphere_prior(jax.random.PRNGKey(1), (B, 16))
  want = 0.0
  for key in (jax.random.PRNGKey(1),):
    want = uot.fur_uot_loss(z, key)[0]
  got = ts.fur_uot_loss(torch.from_numpy(np.asarray(z)), torch.from_numpy(np.asarray(s)))
  assert float(want) > 0
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_eua_coefficients_match_jax():
  """EUA's coefficients from the same deviations (m = 4 clients, 50 parameters)."""
  glob = {'w': jax.random.normal(jax.random.PRNGKey(0), (50,))}
  stacked = {'w': glob['w'] + jax.random.normal(jax.random.PRNGKey(1), (4, 50))}
  gram = fedu2.deviation_gram(glob, stacked)
  want = fedu2.eua_coefficients(gram, jnp.full((4,), 0.25), direction='code', solver='exact',
                                solver_iters=0, server_lr=8.0, step='fixed', admm_c=10.0,
                                admm_rho=1.0)['coef']
  got = ts.eua_coefficients(torch.from_numpy(np.asarray(gram)), 8.0)
  # Both solvers run 2,000 accelerated projected-gradient steps; ours in float32.
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def test_calr_matrix_and_kbar_match_jax():
  """DP-CalR's matrix (before noise) from the same views, and Kbar over two widths."""
  s, c, info = _tiny('fedsc')
  spec = ssl_client.spec_from_config(c, info)
  v = spec.model.init(jax.random.PRNGKey(0), jnp.zeros((2, HW, HW, 3)), train=False)
  params = _perturbed(v['params'], jax.random.PRNGKey(1))
  xs = [jax.random.normal(jax.random.PRNGKey(i), (B, HW, HW, 3)) for i in (2, 3)]
  zs = jnp.stack([spec.model.apply({'params': params}, x, train=False, with_predictor=False)['z']
                  for x in xs])
  want = correlation.view_sum_correlation(zs, 0.7, jnp.ones((B,), bool)) / (2 * B)
  online = ts.make_online('mlp', s.heads, HW)
  ts.load_flax(online, params)
  got = ts.calr_matrix(online, [_nchw(x) for x in xs], 0.7)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-7)
  a1 = jax.random.normal(jax.random.PRNGKey(4), (3, 10, 5))
  a2 = jax.random.normal(jax.random.PRNGKey(5), (2, 10, 7))
  want_k = cka.aggregate_kernel((a1, a2), (jnp.full((3,), 0.2), jnp.full((2,), 0.2)))
  got_k = sum(torch.from_numpy(np.asarray(a)) @ torch.from_numpy(np.asarray(a)).T
              for a in list(a1) + list(a2)) / 5
  np.testing.assert_allclose(got_k.numpy(), want_k, rtol=1e-5, atol=1e-5)


def test_conv_divergence_matches_jax():
  """FedEMA's divergence of the ResNet-18 encoder between two weight sets."""
  flax_model = models.build_ssl_model('resnet18', 'fedu2')
  v = flax_model.init(jax.random.PRNGKey(0), jnp.zeros((2, HW, HW, 3)), train=False)
  after = _perturbed(v['params'], jax.random.PRNGKey(1), 0.01)
  a, b = ts.make_online('resnet18', ts.HEADS['fedu2'], HW), ts.make_online(
      'resnet18', ts.HEADS['fedu2'], HW)
  ts.load_flax(a, v['params'])
  ts.load_flax(b, after)
  want = divergence.conv_divergence(v['params']['encoder'], after['encoder'])
  # float32 sums of squares over up to 2.4M entries a kernel: ~sqrt(N) eps = 1e-4 relative.
  np.testing.assert_allclose(float(ts.conv_divergence(a, b)), float(want), rtol=1e-4)


@pytest.mark.parametrize('name', list(ts.reduced_settings()))
def test_rounds_run(name):
  """Both modes of every row at the reduced size: two rounds, finite losses (the second round
  exercises the state kept across rounds: FedEMA's mixing, Hetero-SSFL's Kbar, FedSC's shares)."""
  s = ts.reduced_settings()[name]
  for mode in ts.MODES:
    one_round = ts.build_round(s, mode=mode, device='cpu')
    assert np.isfinite(one_round()) and np.isfinite(one_round())


def test_bad_values_are_refused():
  s = ts.reduced_settings()['fedema']
  with pytest.raises(ValueError, match="mode = 'stacked' is invalid"):
    ts.build_round(s, mode='stacked', device='cpu')
  with pytest.raises(ValueError, match="encoder = 'vgg' is invalid"):
    ts.make_online('vgg', ts.HEADS['fedu2'])
  with pytest.raises(ValueError, match='has no torch twin'):
    ts.load_flax(ts.make_online('mlp', HEADS, HW), {'encoder': {'conv9': {'kernel': np.zeros(1)}}})


def test_jax_configs_build_every_row():
  """Our config of every paper row builds its algorithm (the seed_speed JAX side)."""
  for name, s in ts.reduced_settings().items():
    c = seed_speed.jax_config(s, 'bfloat16', 2)
    fed, ds = seed_speed.synthetic_fed(s)
    algo = experiment.build_algorithm(c, ds, np.asarray(fed.n))
    assert algo.name.startswith(s.method), (name, algo.name)
