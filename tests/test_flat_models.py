"""`flat_models`: models as flat arrays for jit, their structure read once per model object."""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import flat_models
from dflash_jax.flat_models import flatten_models, unflatten_models


class TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(3, 4, rngs=rngs)
        self.second = nnx.Linear(4, 2, use_bias=False, rngs=rngs)
        self.scale = nnx.Param(jnp.float32(2.0))

    def __call__(self, x):
        return self.second(jax.nn.relu(self.first(x))) * self.scale


def test_round_trip_reads_current_values_and_compiles_once():
    model, x = TwoLayers(nnx.Rngs(0)), jnp.ones((5, 3))
    traces = []

    @functools.partial(jax.jit, static_argnames="treedefs")
    def apply(leaves, x, treedefs):
        traces.append(1)
        return unflatten_models(treedefs, leaves)[0](x)

    treedefs, leaves = flatten_models((model,))
    assert all(a is b for a, b in zip(leaves[0], jax.tree.leaves(model)))
    np.testing.assert_allclose(apply(leaves, x, treedefs=treedefs), model(x), rtol=1e-6)
    model.scale[...] = jnp.float32(-3.0)  # updates in place: the next call must see them
    nnx.update(model.first, jax.tree.map(lambda a: a + 1, nnx.state(model.first)))
    treedefs_again, leaves = flatten_models((model,))
    assert treedefs_again == treedefs
    np.testing.assert_allclose(apply(leaves, x, treedefs=treedefs), model(x), rtol=1e-6)
    assert len(traces) == 1


def test_structure_is_read_once_per_model_object():
    model = TwoLayers(nnx.Rngs(0))
    flatten_models((model,))
    assert model in flat_models._PLANS
    other = TwoLayers(nnx.Rngs(1))
    (_, (mine, theirs)) = flatten_models((model, other))
    assert not np.array_equal(mine[1], theirs[1])  # the first kernels  # each model its own arrays
    dropped = weakref.ref(model)
    del model
    gc.collect()
    # No model kept alive by the cache (other tests' models may still be alive in this process).
    assert dropped() is None and other in flat_models._PLANS


def test_a_variable_holding_several_arrays_is_refused():
    class Pair(nnx.Module):
        def __init__(self):
            self.both = nnx.Variable((jnp.zeros(2), jnp.ones(2)))

    with pytest.raises(TypeError, match="not one array each"):
        flatten_models((Pair(),))
