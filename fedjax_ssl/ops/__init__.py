"""Federation-agnostic primitives (CKA, unbalanced OT, min-norm ADMM, correlation matrices, DP
clipping / noise / accounting, prototypes) for Hetero-SSFL, FedU2, FedSC and representation sharing.
Each arrives with its method's issue; nothing here yet."""
