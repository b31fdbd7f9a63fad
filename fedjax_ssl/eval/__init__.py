"""Evaluation: feature extraction, linear probe, kNN monitor, semi-supervised fine-tuning, and the
field's protocol (L-BFGS logistic-regression probe, weighted kNN, label fractions: `protocol`)."""
from fedjax_ssl.eval.features import extract_features
from fedjax_ssl.eval.features import extract_features_stacked
from fedjax_ssl.eval.features import normalize_images
from fedjax_ssl.eval.finetune import class_balanced_subset
from fedjax_ssl.eval.finetune import semi_supervised_finetune
from fedjax_ssl.eval.finetune import semi_supervised_finetune_stack
from fedjax_ssl.eval.knn import knn_monitor
from fedjax_ssl.eval.knn import knn_predict
from fedjax_ssl.eval.probe import linear_probe
from fedjax_ssl.eval.probe import linear_probe_stack
from fedjax_ssl.eval.logistic import fit_logistic
from fedjax_ssl.eval.logistic import fit_logistic_path
from fedjax_ssl.eval.logistic import select_and_refit
from fedjax_ssl.eval.protocol import evaluate_features
from fedjax_ssl.eval.protocol import knn_accuracy
from fedjax_ssl.eval.protocol import logistic_probe
from fedjax_ssl.eval.protocol import stratified_subset
