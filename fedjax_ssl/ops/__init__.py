"""Federation-agnostic primitives of the papers' methods, pure and jittable.

  uot.py       quadratic-penalty unbalanced OT (`solve_l2_uot`), FedU2's FUR (`fur_uot_loss`) and the
               FedU2 code's tangent-space sliced Wasserstein loss (`tangent_swd_loss`)
  min_norm.py  min over the simplex of p^T G p (`simplex_min_norm`: exact, ADMM, the printed ADMM)

  correlation.py  FedSC's NormClip, multi-view correlation estimators (Eq. 33), a client's DP-CalR
               accumulator and the server's weighted-sum / leave-one-out / replacement bookkeeping
  privacy.py   DP-CalR's Gaussian noise and its privacy ledger on Google's dp-accounting
               (`sensitivity`, `epsilon`, `calibrate_sigma`, `PrivacyLedger`)

  cka.py       Hetero-SSFL's centred kernel alignment: `linear_cka` (feature-space form), `rbf_cka`,
               `aggregate_kernel` (K̄ = Σ w_j A_j A_jᵀ), `cka_distance_to_kernel` (1 - CKA against a
               given kernel) and `cka_distance_to_aggregate` (the same from the feature matrices, memory
               O(Σ d_j²) instead of O(L²))

  numerics.py  helpers the ops and the SSL losses share: `as_float` (at least float32),
               `check_positive` (a concrete number must be > 0)

  decorr.py    FedDecorr's decorrelation loss of a batch (`feddecorr_loss`)
  ldawa.py     L-DAWA's layer-wise cosine-scaled aggregation (`aggregate`, `layer_scales`)
  fedca.py     FedCA's dictionary (`dictionary_entries`, `update_dictionary`, `select_negatives`), its
               two dictionary-contrastive losses (`code_dictionary_loss`, `dictionary_nt_xent`) and
               the alignment loss (`alignment_loss`)
  orchestra.py Orchestra's equal-size clustering: `sinkhorn_knopp`, the memory bank (`memory_push`,
               `memory_fill`), `local_clustering`, `global_clustering`, the clustering loss
               (`cluster_loss`) and the rotations of its degeneracy term (`rotate90`)
  ssd.py       SSD's dimension-scaled regularisation (`dsr_loss`), projector distillation
               (`distillation_loss`), the per-client scaling vectors (`scaling_vectors`) and the
               shared basis (`orthogonal_basis`)

Prototypes (representation sharing) arrive with their method.
"""
