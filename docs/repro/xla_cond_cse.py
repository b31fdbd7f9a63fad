"""Reproducer (jax 0.10.2, XLA:CPU; a missed optimisation, ready to report upstream): XLA merges two
identical computations (CSE) at top level, in a scan body and in a lone `lax.cond` branch, but not
in a `lax.cond` branch inside a scan when the computations read equal constants that JAX passed to
the conditional as two separate operands. Prints the number of dot instructions after optimisation
per program; expected 1 everywhere, observed {'top-level': 1, 'scan': 1, 'cond': 1, 'scan+cond': 2}.

In fedjax_ssl this made a FedBYOL step with augmentation 'none' (two identical views, each
normalised with its own `jnp.asarray(mean)` constant) cost half as much at top level as inside the
engine's old scan + masking cond (docs/notes/performance.md#scan-vs-step).

  python docs/repro/xla_cond_cse.py
"""
import jax
import jax.numpy as jnp

SCALE = (0.5,)  # a Python tuple: each jnp.asarray call makes a new constant


def f(w, x):
  # Two equal 'views', each scaled by its own device constant (as normalize(x, mean, std) does).
  v1, v2 = x * jnp.asarray(SCALE, jnp.float32), x * jnp.asarray(SCALE, jnp.float32)
  return jnp.tanh(v1 @ w).sum() + jnp.tanh(v2 @ w).sum()


w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
programs = {
    'top-level': (jax.jit(f), (w, x)),
    'scan': (jax.jit(lambda w, x: jax.lax.scan(lambda c, _: (c + f(w, x), None), 0.0, None,
                                               length=4)[0]), (w, x)),
    'cond': (jax.jit(lambda w, x, p: jax.lax.cond(p, lambda: f(w, x), lambda: 0.0)), (w, x, True)),
    'scan+cond': (jax.jit(lambda w, x: jax.lax.scan(
        lambda c, s: (c + jax.lax.cond(s < 3, lambda: f(w, x), lambda: 0.0), None), 0.0,
        jnp.arange(4))[0]), (w, x)),
}
print('jax', jax.__version__,
      {k: fn.lower(*a).compile().as_text().count(' dot(') for k, (fn, a) in programs.items()})
