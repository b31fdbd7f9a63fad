"""Cost of config.per_client_eval on the quickstart federation (docs/notes/evaluation.md#eval-26)."""
import json, os, time
import jax, numpy as np
from configs import quickstart
from fedjax_ssl import evaluation, experiment
from fedjax_ssl.core import round as rd
from fedjax_ssl.eval import protocol

out = {'load_before': os.getloadavg()}
for algorithm in ('fedavg', 'independent'):
  c = quickstart.get_config(); c.algorithm = algorithm; c.per_client_eval = True
  experiment.validate_config(c)
  ds = experiment.load_data(c)
  fed, _ = experiment.build_fed_data(c, ds)
  t = time.time(); splits = evaluation.client_test_splits(c, ds, fed); t_split = time.time() - t
  algo = experiment.build_algorithm(c, ds, client_sizes=np.asarray(fed.n))
  state = rd.init_state(algo, experiment.run_keys(c)[0], c.num_clients)
  times = []
  for rep in range(2):  # the first call compiles
    t = time.time(); entries, summary = evaluation.per_client_results(c, algo, state, ds, fed, splits)
    times.append(time.time() - t)
  # the kNN monitor of the existing evaluation (knn_acc only), for scale
  t = time.time(); experiment.evaluate(c, algo, state, ds, probe=False); t_monitor = time.time() - t
  out[algorithm] = dict(split_seconds=t_split, per_client_seconds=times, knn_monitor_seconds=t_monitor,
                        n_test=[int(s.size) for s in splits], n_train=[int(n) for n in np.asarray(fed.n)],
                        summary={k: round(v, 4) for k, v in summary.items()})
  print(algorithm, json.dumps(out[algorithm]), flush=True)
# One L-BFGS probe (the protocol's, C grid of 10) on the smallest client's own images, random-init
# features of the global model: what a probe per client per model would cost instead of the kNN.
c = quickstart.get_config(); ds = experiment.load_data(c); fed, _ = experiment.build_fed_data(c, ds)
algo = experiment.build_algorithm(c, ds, client_sizes=np.asarray(fed.n))
state = rd.init_state(algo, experiment.run_keys(c)[0], c.num_clients)
v, _ = algo.eval_variables(state)
x, y = np.asarray(fed.x), np.asarray(fed.y)
o, n = int(np.asarray(fed.offsets)[0]), int(np.asarray(fed.n)[0])
bank = np.asarray(experiment.encoder_features(algo, v, False, x[o:o + n], ds))
test = np.asarray(experiment.encoder_features(algo, v, False, ds.test_x, ds))
times = []
for rep in range(2):
  t = time.time()
  try:
    protocol.logistic_probe(bank, y[o:o + n], test, ds.test_y, ds.num_classes)
  except ValueError as e:
    print('probe refused:', e)
  times.append(time.time() - t)
out['probe_one_client'] = dict(n_bank=n, seconds=times)
out['load_after'] = os.getloadavg()
print(json.dumps(out['probe_one_client']), out['load_before'], out['load_after'], flush=True)
json.dump(out, open('docs/results/per_client/cost.json', 'w'), indent=1)
