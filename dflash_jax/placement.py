"""A model's parameters placed straight into their shards of a mesh: each device receives its
slices only, cut from host arrays (`jax.make_array_from_callback`), never a whole matrix. The
fused matrices are reordered first (`shard_layout`), and the placed model remembers its mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.experts import RoutedExperts
from dflash_jax.layers import MLP, Attention
from dflash_jax.models import Drafter, Target, abstract_model
from dflash_jax.models.gated_delta_net import GatedDeltaNet
from dflash_jax.quantization import params_of
from dflash_jax.shard_layout import linear_attention_shards, sharded_config, to_shard_layout
from dflash_jax.sharding import param_spec, tensor_parallel_size


def place_model(cfg: TargetConfig | DrafterConfig, dtype, params: dict, mesh: Mesh | None) -> Target | Drafter:
    """A model from a nested dict of host arrays (`nnx.to_pure_dict` layout, one-device column
    order), each float parameter cast to `dtype` (8-bit weights and their scales kept) and sent
    to its shards of `mesh` (to the default device when `mesh` is None): a device receives its
    slices only, never a whole matrix."""
    shards = tensor_parallel_size(mesh)
    if mesh is not None:
        params = to_shard_layout(cfg, params, shards)
        cfg = sharded_config(cfg, shards)
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    abstract = {path: variable for path, variable in nnx.to_flat_state(state)}

    def place(path, value):
        variable = abstract[tuple(int(key) if str(key).isdigit() else key for key in path)]
        want = variable.dtype  # `dtype`, or a quantized layer's 8-bit values and float32 scales
        if mesh is None:
            return jnp.asarray(value, want)
        spec = param_spec(variable.get_metadata().get("out_sharding"), variable.shape, shards)
        host = np.asarray(value).astype(want)
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])

    flat = traverse_util.flatten_dict(params)
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict({path: place(path, value) for path, value in flat.items()}))
    model = nnx.merge(graphdef, state)
    if mesh is not None:
        model.mesh = mesh
        for _, module in nnx.iter_graph(model):
            if isinstance(module, (Attention, MLP)):
                module.shards = shards
            elif isinstance(module, GatedDeltaNet):
                module.shards = linear_attention_shards(cfg, shards)
                module.mesh = mesh
            elif isinstance(module, RoutedExperts):
                module.mesh = mesh
    return model


def shard_model(model: Target | Drafter, mesh: Mesh | None):
    """`model` placed on `mesh`: itself if it is there already, else a new model from its
    parameters (copied to the host once). A model placed on another mesh is refused."""
    current = getattr(model, "mesh", None)
    if current is mesh or current == mesh:
        return model
    if current is not None:
        raise ValueError("this model is placed on another mesh; load it again with the mesh you run it on.")
    params = jax.device_get(params_of(model))
    placed = place_model(model.cfg, model.dtype, params, mesh)
    if hasattr(model, "head_DV"):
        placed.transpose_tied_head()
    return placed


def on_one_mesh(models, mesh: Mesh | None) -> tuple:
    """`models` (None entries kept) on one mesh: placed on `mesh` when it is given
    (`shard_model`), else as they are, which must then share one mesh (or none)."""
    if mesh is not None:
        return tuple(None if model is None else shard_model(model, mesh) for model in models)
    meshes = {model.mesh for model in models if model is not None}
    if len(meshes) > 1:
        raise ValueError("the models are placed on different meshes (or some on none); load them with one mesh.")
    return tuple(models)
