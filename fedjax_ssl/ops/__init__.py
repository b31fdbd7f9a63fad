"""Federation-agnostic primitives of the papers' methods, pure and jittable.

  uot.py       quadratic-penalty unbalanced OT (`solve_l2_uot`), FedU2's FUR (`fur_uot_loss`) and the
               FedU2 code's tangent-space sliced Wasserstein loss (`tangent_swd_loss`)
  min_norm.py  min over the simplex of p^T G p (`simplex_min_norm`: exact, ADMM, the printed ADMM)

CKA (Hetero-SSFL), correlation matrices and DP accounting (FedSC) and prototypes (representation
sharing) arrive with their methods.
"""
