"""Models handed to a jitted program as flat lists of arrays, their structure walked once.

An NNX module passed to `jax.jit` as a pytree is flattened in Python at every call, a fixed
cost of every batch-1 `generate` call that grows with the model's Variables (measured in
`python -m bench.decode.generate_overhead`). Here a model's
structure (its treedef and Variable objects) is read once per model object, and each call
reads only the Variables' current values: updates in place (`variable[...] = ...`,
`nnx.update`) are seen. Replacing a Variable or a submodule of a model that has already been
used is not: load or build a new model object instead.
"""

from __future__ import annotations

import weakref

import jax
from flax import nnx

_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def flatten_models(models: tuple) -> tuple[tuple, tuple[list[jax.Array], ...]]:
    """(treedefs, leaves) for `unflatten_models`: the treedefs are static (hashable), the
    leaves each model's current parameter arrays."""
    plans = [_plan(model) for model in models]
    return (tuple(treedef for treedef, _ in plans),
            tuple([variable.get_raw_value() for variable in variables] for _, variables in plans))


def unflatten_models(treedefs: tuple, leaves: tuple) -> tuple:
    """The models again, inside the jitted program (holding its tracers)."""
    return tuple(jax.tree.unflatten(treedef, model_leaves) for treedef, model_leaves in zip(treedefs, leaves))


def _plan(model):
    """(treedef, Variables in leaf order) of `model`, read at its first use."""
    plan = _PLANS.get(model)
    if plan is None:
        variables, _ = jax.tree.flatten(model, is_leaf=lambda x: isinstance(x, nnx.Variable))
        leaves, treedef = jax.tree.flatten(model)
        # A Variable flattens to its raw value: one leaf each, in the same order.
        if len(variables) != len(leaves) or any(
            not isinstance(v, nnx.Variable) or v.get_raw_value() is not leaf for v, leaf in zip(variables, leaves)
        ):
            raise TypeError(f"{type(model).__name__} holds Variables that are not one array each; pass models "
                            "whose Variables each hold one array (dflash_jax's Target and Drafter do).")
        plan = _PLANS[model] = (treedef, variables)
    return plan


def has_run(model) -> bool:
    """Whether a program has read `model`'s structure already (its first use): from then on
    a change to its structure would not be seen."""
    return model in _PLANS
