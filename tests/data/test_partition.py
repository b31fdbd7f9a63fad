"""Tests of fedjax_ssl.data.partition against independent numpy/scipy references."""
import numpy as np
import pytest
import scipy.stats

from fedjax_ssl.data import partition as P
from fedjax_ssl.data import sources


def _balanced_labels(num_classes, per_class, seed=0):
  return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def _check_disjoint_cover(parts, expected_union):
  allidx = np.concatenate(parts)
  assert allidx.size == np.unique(allidx).size, 'an example is used twice'
  np.testing.assert_array_equal(np.sort(allidx), np.sort(expected_union))


def _label_sets(labels, parts):
  return [set(np.unique(labels[p]).tolist()) for p in parts]


# ---------------------------------------------------------------------------------------------
# partition
# ---------------------------------------------------------------------------------------------
def test_iid_equal_sizes_and_cover():
  labels = np.random.default_rng(1).integers(0, 10, 1003)
  parts = P.partition(labels, 7, 'iid', seed=3)
  sizes = sorted(p.size for p in parts)
  # 1003 = 7 * 143 + 2: two clients get 144, five get 143.
  assert sizes == [143] * 5 + [144] * 2
  _check_disjoint_cover(parts, np.arange(1003))
  assert all(p.dtype == np.int64 for p in parts)


def test_iid_is_label_balanced_in_expectation():
  # An IID split draws each client's labels like a random sample: with 1,000 examples/client,
  # every class fraction is within 5 points of 0.1 (binomial std ~0.0095).
  labels = _balanced_labels(10, 1000)
  parts = P.partition(labels, 10, 'iid', seed=0)
  fractions = np.stack([np.bincount(labels[p], minlength=10) / p.size for p in parts])
  assert np.abs(fractions - 0.1).max() < 0.05


def test_dirichlet_cover_and_min_size():
  labels = _balanced_labels(10, 200)
  parts = P.partition(labels, 20, 'dirichlet', seed=0, alpha=0.1, min_size=10)
  _check_disjoint_cover(parts, np.arange(labels.size))
  assert min(p.size for p in parts) >= 10


def _mean_max_class_fraction(alpha, seeds):
  labels = _balanced_labels(10, 300)
  out = []
  for seed in seeds:
    for p in P.partition(labels, 10, 'dirichlet', seed=seed, alpha=alpha, min_size=1):
      out.append(np.bincount(labels[p], minlength=10).max() / p.size)
  return float(np.mean(out))


def _mean_label_entropy(alpha, seeds):
  labels = _balanced_labels(10, 300)
  out = []
  for seed in seeds:
    for p in P.partition(labels, 10, 'dirichlet', seed=seed, alpha=alpha, min_size=1):
      out.append(scipy.stats.entropy(np.bincount(labels[p], minlength=10)))
  return float(np.mean(out))


def test_dirichlet_skew_grows_as_alpha_shrinks():
  seeds = range(5)
  frac = {a: _mean_max_class_fraction(a, seeds) for a in (0.1, 1.0, 100.0)}
  ent = {a: _mean_label_entropy(a, seeds) for a in (0.1, 1.0, 100.0)}
  assert frac[0.1] > frac[1.0] > frac[100.0]
  assert ent[0.1] < ent[1.0] < ent[100.0]
  # alpha=100 is near-uniform (max fraction ~0.1, entropy ~log 10); alpha=0.1 is dominated by
  # one or two classes.
  assert frac[100.0] < 0.2 and frac[0.1] > 0.5
  assert ent[100.0] > 0.95 * np.log(10) and ent[0.1] < 0.5 * np.log(10)


def test_dirichlet_share_has_beta_moments():
  # A client's share of one class is Beta(alpha, (C-1) alpha): mean 1/C,
  # variance (1/C)(1 - 1/C) / (C alpha + 1). min_size=0 keeps the draw unconditioned.
  num_clients, alpha, per_class = 5, 0.5, 1000
  labels = _balanced_labels(4, per_class)
  shares = []
  for seed in range(150):
    parts = P.partition(labels, num_clients, 'dirichlet', seed=seed, alpha=alpha, min_size=0)
    shares.append(P.class_histogram(labels, parts, 4) / per_class)
  shares = np.stack(shares).ravel()
  ref = scipy.stats.beta(alpha, (num_clients - 1) * alpha)
  assert abs(shares.mean() - ref.mean()) < 1e-9  # the shares of one class sum to exactly 1
  assert abs(shares.var() - ref.var()) < 0.1 * ref.var()


def test_dirichlet_impossible_min_size_raises():
  labels = _balanced_labels(10, 10)
  with pytest.raises(ValueError, match='draw'):
    P.partition(labels, 10, 'dirichlet', seed=0, alpha=0.01, min_size=10, max_draws=5)


def test_classes_disjoint_identity_order_fedsc():
  labels = _balanced_labels(10, 50)
  parts = P.partition(labels, 5, 'classes', seed=0, classes_per_client=2)
  assert _label_sets(labels, parts) == [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}]
  _check_disjoint_cover(parts, np.arange(labels.size))  # every instance of the held classes


def test_classes_disjoint_cifar100_layout():
  labels = _balanced_labels(100, 5)
  parts = P.partition(labels, 20, 'classes', seed=0, classes_per_client=5)
  assert _label_sets(labels, parts) == [set(range(5 * i, 5 * i + 5)) for i in range(20)]


def test_classes_fewer_slots_than_classes_leaves_classes_unused():
  labels = _balanced_labels(10, 30)
  parts = P.partition(labels, 3, 'classes', seed=0, classes_per_client=2)
  assert _label_sets(labels, parts) == [{0, 1}, {2, 3}, {4, 5}]
  _check_disjoint_cover(parts, np.flatnonzero(labels < 6))


def test_classes_shuffled_are_disjoint_and_seeded():
  labels = _balanced_labels(10, 20)
  sets = _label_sets(labels, P.partition(labels, 5, 'classes', seed=4, classes_per_client=2,
                                         shuffle_classes=True))
  assert all(len(s) == 2 for s in sets)
  assert set().union(*sets) == set(range(10))
  assert sum(len(s) for s in sets) == 10  # pairwise disjoint
  assert sets != [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}]


@pytest.mark.parametrize('shuffle', [False, True])
def test_classes_shard_mode(shuffle):
  num_clients, k, num_classes, per_class = 100, 5, 100, 23
  labels = _balanced_labels(num_classes, per_class)
  parts = P.partition(labels, num_clients, 'classes', seed=1, classes_per_client=k,
                      shuffle_classes=shuffle)
  _check_disjoint_cover(parts, np.arange(labels.size))
  hist = np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])
  assert ((hist > 0).sum(axis=1) == k).all()          # exactly k classes per client
  holders = (hist > 0).sum(axis=0)
  assert (holders == num_clients * k // num_classes).all()  # each class held by 5 clients
  for c in range(num_classes):  # 23 examples over 5 holders: sizes 5,5,5,4,4
    assert sorted(hist[hist[:, c] > 0, c].tolist()) == [4, 4, 5, 5, 5]


def test_classes_shard_mode_requires_divisibility():
  labels = _balanced_labels(10, 10)
  with pytest.raises(ValueError, match='multiple'):
    P.partition(labels, 7, 'classes', seed=0, classes_per_client=3)


def test_classes_empty_client_raises():
  labels = np.array([0, 0, 0, 1, 1, 1, 2])  # class 2 has one example but two holders
  with pytest.raises(ValueError, match='without examples'):
    P.partition(labels, 6, 'classes', seed=0, classes_per_client=1, num_classes=3)


@pytest.mark.parametrize('scheme,kw', [('iid', {}), ('dirichlet', dict(alpha=0.5)),
                                       ('classes', dict(classes_per_client=2))])
def test_partition_is_deterministic(scheme, kw):
  labels = _balanced_labels(10, 40)
  a = P.partition(labels, 5, scheme, seed=7, **kw)
  b = P.partition(labels, 5, scheme, seed=7, **kw)
  c = P.partition(labels, 5, scheme, seed=8, **kw)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize('args,kw,match', [
    ((0, 'iid'), {}, 'num_clients=0'),
    ((101, 'iid'), {}, 'num_clients=101'),
    ((5, 'bogus'), {}, 'bogus'),
    ((5, 'dirichlet'), dict(alpha=0.0), 'alpha=0.0'),
    ((5, 'dirichlet'), dict(alpha=-1.0), 'alpha=-1.0'),
    ((5, 'dirichlet'), {}, 'alpha=None'),
    ((5, 'dirichlet'), dict(alpha=1.0, min_size=21), 'min_size=21'),
    ((5, 'classes'), dict(classes_per_client=0), 'classes_per_client=0'),
    ((5, 'classes'), dict(classes_per_client=11), 'classes_per_client=11'),
    ((5, 'classes'), {}, 'classes_per_client'),
    ((5, 'iid'), dict(alpha=0.1), 'alpha=0.1'),
    ((5, 'dirichlet'), dict(alpha=1.0, classes_per_client=2), 'classes_per_client=2'),
])
def test_partition_validation(args, kw, match):
  labels = _balanced_labels(10, 10)
  with pytest.raises(ValueError, match=match):
    P.partition(labels, *args, seed=0, **kw)


def test_partition_rejects_bad_labels():
  with pytest.raises(ValueError, match='1-D integer'):
    P.partition(np.zeros((4, 2), np.int32), 2, 'iid', seed=0)
  with pytest.raises(ValueError, match='num_classes=3'):
    P.partition(np.array([0, 1, 5]), 2, 'iid', seed=0, num_classes=3)


# ---------------------------------------------------------------------------------------------
# carve_public
# ---------------------------------------------------------------------------------------------
def test_carve_public_random():
  labels = _balanced_labels(10, 30)
  pub, rest = P.carve_public(labels, 50, seed=0)
  assert pub.size == 50 and rest.size == 250
  assert np.intersect1d(pub, rest).size == 0
  np.testing.assert_array_equal(np.union1d(pub, rest), np.arange(300))
  pub2, _ = P.carve_public(labels, 50, seed=0)
  pub3, _ = P.carve_public(labels, 50, seed=1)
  np.testing.assert_array_equal(pub, pub2)
  assert not np.array_equal(pub, pub3)


def test_carve_public_stratified():
  labels = np.repeat(np.arange(4), [100, 200, 300, 400])
  pub, rest = P.carve_public(labels, 101, seed=0, stratified=True)
  # 101 * (0.1, 0.2, 0.3, 0.4) = 10.1, 20.2, 30.3, 40.4 -> floors 10,20,30,40 (100) plus one for
  # the largest remainder (class 3, 0.4).
  np.testing.assert_array_equal(np.bincount(labels[pub], minlength=4), [10, 20, 30, 41])
  assert np.intersect1d(pub, rest).size == 0 and pub.size + rest.size == labels.size


def test_carve_public_validation():
  labels = _balanced_labels(10, 3)
  with pytest.raises(ValueError, match='size=30'):
    P.carve_public(labels, 30, seed=0)
  with pytest.raises(ValueError, match='size=-1'):
    P.carve_public(labels, -1, seed=0)
  pub, rest = P.carve_public(labels, 0, seed=0)
  assert pub.size == 0 and rest.size == 30


# ---------------------------------------------------------------------------------------------
# build_fed_data
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def tiny_dataset():
  return sources.make_synthetic(0, num_train=400, num_test=20, image_shape=(6, 5, 2),
                                num_classes=10)


@pytest.mark.parametrize('scheme,kw', [('iid', {}), ('dirichlet', dict(alpha=0.3)),
                                       ('classes', dict(classes_per_client=2))])
def test_build_fed_data(tiny_dataset, scheme, kw):
  ds = tiny_dataset
  fed, info = P.build_fed_data(ds, 5, scheme, seed=3, public_size=40, **kw)
  n = np.asarray(fed.n)
  # The device arrays hold exactly the real rows, client after client.
  assert fed.x.shape == (n.sum(), 6, 5, 2) and fed.y.shape == (n.sum(),)
  np.testing.assert_array_equal(np.asarray(fed.offsets), np.cumsum(n) - n)
  x, y = fed.padded()
  assert x.dtype == np.uint8 and y.dtype == np.int32 and n.dtype == np.int32
  assert x.shape == (5, n.max(), 6, 5, 2) and y.shape == (5, n.max())
  assert fed.num_clients == 5 and fed.n_max == n.max()
  for c in range(5):  # the traced padded view equals the host one
    cx, cy, cn = fed.client(c)
    np.testing.assert_array_equal(np.asarray(cx), x[c])
    np.testing.assert_array_equal(np.asarray(cy), y[c])
    assert int(cn) == n[c]
  # Sizes add up and no example is used twice (public set included).
  assert n.sum() == 400 - 40
  _check_disjoint_cover(info['indices'] + [info['public_idx']], np.arange(400))
  for c in range(5):
    idx = info['indices'][c]
    assert idx.size == n[c]
    np.testing.assert_array_equal(x[c, :n[c]], ds.train_x[idx])
    np.testing.assert_array_equal(y[c, :n[c]], ds.train_y[idx])
    assert (x[c, n[c]:] == 0).all() and (y[c, n[c]:] == -1).all()
  # Histogram equals an independent bincount of the stacked labels.
  ref = np.stack([np.bincount(y[c, :n[c]], minlength=10) for c in range(5)])
  assert info['histogram'].dtype == np.int64
  np.testing.assert_array_equal(info['histogram'], ref)
  np.testing.assert_array_equal(np.asarray(fed.public_x), ds.train_x[info['public_idx']])
  # on_host (placement 'divided'): the same arrays, as numpy, nothing on a device.
  host, _ = P.build_fed_data(ds, 5, scheme, seed=3, public_size=40, on_host=True, **kw)
  for a, b in zip((host.x, host.y, host.n, host.offsets, host.public_x),
                  (fed.x, fed.y, fed.n, fed.offsets, fed.public_x)):
    assert isinstance(a, np.ndarray) and a.dtype == b.dtype
    np.testing.assert_array_equal(a, np.asarray(b))
  assert (host.n_max, host.n_min) == (fed.n_max, fed.n_min)


def test_build_fed_data_no_public_and_determinism(tiny_dataset):
  fed1, info1 = P.build_fed_data(tiny_dataset, 4, 'dirichlet', seed=5, alpha=0.5)
  fed2, info2 = P.build_fed_data(tiny_dataset, 4, 'dirichlet', seed=5, alpha=0.5)
  assert fed1.public_x is None and info1['public_idx'].size == 0
  assert int(np.asarray(fed1.n).sum()) == 400
  np.testing.assert_array_equal(np.asarray(fed1.x), np.asarray(fed2.x))
  np.testing.assert_array_equal(info1['histogram'], info2['histogram'])


@pytest.mark.parametrize('kw,match', [
    (dict(public_size=400), 'public_size=400'),
    (dict(public_size=-3), 'public_size=-3'),
    (dict(alpha=0.0), 'alpha=0.0'),
    (dict(alpha=1.0, foo=1), 'foo'),
    (dict(alpha=1.0, public_size=398), 'num_clients=4'),  # 2 examples left for 4 clients
])
def test_build_fed_data_validation(tiny_dataset, kw, match):
  with pytest.raises(ValueError, match=match):
    P.build_fed_data(tiny_dataset, 4, 'dirichlet', seed=0, **kw)


def test_format_histogram():
  hist = np.array([[3, 0, 1], [0, 12, 0]])
  text = P.format_histogram(hist)
  lines = text.splitlines()
  assert lines[0].split() == ['client', 'n', '0', '1', '2']
  assert lines[2].split() == ['0', '4', '3', '0', '1']
  assert lines[3].split() == ['1', '12', '0', '12', '0']
  assert lines[-1].split() == ['total', '16', '3', '12', '1']
  wide = np.zeros((2, 30), np.int64)
  wide[0, 7], wide[1, 29] = 5, 2
  lines = P.format_histogram(wide).splitlines()
  assert lines[2].split() == ['0', '5', '1', '7:5'] and lines[3].split() == ['1', '2', '1', '29:2']
  with pytest.raises(ValueError, match='shape'):
    P.format_histogram(np.zeros(3))
