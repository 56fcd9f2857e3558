"""How an `AccumulatingOptimizer` cycle's mean gradient updates the inner optimizer.

Overwritten variables (float8 scales and amax histories) take the maximum over replicas;
the rest is clipped once, as the all-reduced whole, with the wrapper's clipping options;
then the inner optimizer applies it, without its `iterations` increment where TensorFlow
has no `merge_call` (XLA on GPUs). Copied with `optimizer.py` and `non_finite.py`: it
imports only TensorFlow, Keras and `distgrad.non_finite`, or, copied into a project,
`non_finite`. Design notes: docs/design.md, "AccumulatingOptimizer".
"""

from __future__ import annotations

import tensorflow as tf

try:
    from distgrad.non_finite import CLIP_OPTIONS
except ImportError:  # copied into a project: non_finite.py beside this file
    from non_finite import CLIP_OPTIONS


def overwritten(variable) -> bool:
    """float8 scales and amax histories: assigned, not stepped."""
    return getattr(variable, "overwrite_with_gradient", False)


def apply_to_inner(optimizer, grads, variables) -> None:
    """Replica context: `grads`, this replica's share of the mean gradient (overwritten
    variables: its maximum), updates `optimizer.inner_optimizer`."""
    flags = [overwritten(v) for v in variables]
    context = tf.distribute.get_replica_context()
    if any(flags) and context is not None and context.num_replicas_in_sync > 1:
        grads = [tf.reduce_max(context.all_gather(g[None], axis=0), axis=0) if o else g
                 for g, o in zip(grads, flags)]  # ReduceOp has no MAX: gather
    rest = [i for i, o in enumerate(flags) if not o]  # Keras clips those only
    if rest and any(getattr(optimizer, option) for option in CLIP_OPTIONS):
        for i, clipped in zip(rest, clip_across_replicas(optimizer, [grads[i] for i in rest])):
            grads[i] = clipped
    inner = optimizer.inner_optimizer
    if not tf.__internal__.distribute.strategy_supports_no_merge_call():
        inner.apply(grads, variables)
    else:  # BaseOptimizer.apply without its `iterations` increment (docs/design.md)
        grads, variables = inner._overwrite_variables_directly_with_gradients(grads, variables)
        if grads:
            if inner.loss_scale_factor is not None:
                grads = [g / inner.loss_scale_factor for g in grads]
            inner._backend_apply_gradients(grads, variables)
            for variable in variables:
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))


def clip_across_replicas(optimizer, local_grads) -> list:
    """Clip the summed gradient on replica 0, zeros elsewhere: the inner update SUMs again."""
    context = tf.distribute.get_replica_context()
    clipped = optimizer._clip_gradients(
        context.all_reduce(tf.distribute.ReduceOp.SUM, local_grads))
    is_first = tf.equal(context.replica_id_in_sync_group, 0)
    return [tf.where(is_first, c, tf.zeros_like(c)) for c in clipped]
