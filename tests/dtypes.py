"""Dtype inspection shared by the mixed-precision tests (tests/models/test_precision.py and the
registry's bf16 sweep in tests/algorithms/test_registry.py)."""
import jax
import jax.numpy as jnp


def contractions(jaxpr):
  """(primitive, operand dtypes) of every dot_general / convolution in `jaxpr` and the jaxprs nested
  in it (jit, custom_vjp, while, cond, scan)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ('dot_general', 'conv_general_dilated'):
      yield eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        sub = getattr(sub, 'jaxpr', sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, 'eqns'):
          yield from contractions(sub)


def float_dtypes(tree):
  return {str(a.dtype) for a in jax.tree_util.tree_leaves(tree)
          if jnp.issubdtype(a.dtype, jnp.floating)}


def encoder_applies(algo, state):
  """(encoder_apply, one client's or the global variables) per cohort (one without cohorts)."""
  variables, per_client = algo.eval_variables(state)
  pairs = ([(c.client.encoder_apply, v) for c, v in zip(algo.cohorts, variables)] if algo.cohorts
           else [(algo.encoder_apply, variables)])
  first = lambda v: jax.tree_util.tree_map(lambda a: a[0], v) if per_client else v
  return [(apply, first(v)) for apply, v in pairs]
