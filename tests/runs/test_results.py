"""fedjax_ssl.runs.results: the best kNN over rounds."""
from fedjax_ssl.runs import results


def test_best_over_rounds_skips_the_random_init_row_and_takes_the_first_best():
  records = [{'round': 0, 'knn_acc': 0.9}, {'round': 1, 'loss': 2.0},
             {'round': 5, 'knn_acc': 0.61}, {'round': 10, 'knn_acc': 0.64},
             {'round': 15, 'knn_acc': 0.64}, {'round': 20, 'knn_acc': 0.62}]
  assert results.best_over_rounds(records, 'knn_acc') == {'knn_acc_best': 0.64,
                                                          'knn_acc_best_round': 10}
  assert results.best_over_rounds(records[:2], 'knn_acc') == {}
