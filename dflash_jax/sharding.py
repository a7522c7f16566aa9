"""Tensor parallelism over a `jax.sharding.Mesh` with axes ("data", "model").

The mesh (`make_mesh`) and the one rule from a parameter's logical axes to its `PartitionSpec`
(`param_spec`), by which `placement` puts a model's parameters straight into their shards. A
placed model remembers its mesh (`model.mesh`), and the runtime follows it: KV caches are sharded by kv
head (`kv_cache_sharding`) and each layer's head finish, cache write and paged attention run
once per shard under `shard_map` (`per_shard`); the rest is left to XLA's partitioner, which
puts one all-reduce after each row-parallel product (o_proj, down_proj, the drafter's fc).

    q/k/v, gate/up  column-parallel ("qkv_heads", "mlp" on their output axis)
    routed experts  expert-parallel ("experts": each device holds its share, sees every token)
    o, down, fc     row-parallel ("q_heads", "mlp" on their input axis)
    embedding, head vocab-sharded ("vocab"); greedy argmaxes combine per-shard (max, index)
    norms, biases of row-parallel products   replicated
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


DATA, MODEL = "data", "model"
# The logical axes (layers.py) split over "model"; every other axis is replicated.
MODEL_AXES = frozenset({"vocab", "q_heads", "qkv_heads", "mlp", "experts"})
# A layer's heads [T, heads, H] and kv cache [slots, kv heads, H], split by head.
HEADS = PartitionSpec(None, MODEL, None)


def make_mesh(tensor_parallel: int = 1, data_parallel: int | None = None, *, devices=None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: every device of every process):
    `tensor_parallel` devices per model replica, `data_parallel` replicas (default: as many
    as the devices hold)."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel < 1 or len(devices) % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} must be >= 1 and divide the {len(devices)} devices.")
    if data_parallel is None:
        data_parallel = len(devices) // tensor_parallel
    if data_parallel < 1 or data_parallel * tensor_parallel > len(devices):
        raise ValueError(f"data_parallel={data_parallel} x tensor_parallel={tensor_parallel} needs more than the "
                         f"{len(devices)} devices there are; lower one of them.")
    used = devices[: data_parallel * tensor_parallel]
    return jax.make_mesh((data_parallel, tensor_parallel), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2,
                         devices=used)


def tensor_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[MODEL]


def param_spec(logical_axes: tuple[str | None, ...] | None, shape: tuple[int, ...], shards: int) -> PartitionSpec:
    """Where a parameter lives: each axis named in `MODEL_AXES` (and of a size that divides
    into `shards`) split over "model", every other axis replicated."""
    axes = logical_axes or (None,) * len(shape)
    return PartitionSpec(*(MODEL if name in MODEL_AXES and size % shards == 0 else None
                           for name, size in zip(axes, shape)))


def replicated(x, mesh: Mesh | None):
    """`x` kept whole on every device of `mesh` (as it is without one): the residual stream
    between layers, which XLA would otherwise split to suit a consumer (the drafter's
    row-parallel fc reading the target's features), adding gathers to every layer."""
    return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))


def kv_cache_sharding(mesh: Mesh | None):
    """Where a kv cache [slots, kv heads, H] lives: split by kv head (None: the default device)."""
    return None if mesh is None else NamedSharding(mesh, HEADS)


def per_shard(mesh: Mesh | None, fn: Callable, num_split: int) -> Callable:
    """`fn(*split, shared)` once per shard of `mesh` under `shard_map`: its first `num_split`
    arguments and its outputs are arrays [T, heads, H] (heads, kv caches) split by head,
    `shared` a pytree of arrays every shard sees whole. Without a mesh, `fn` itself. Each
    shard runs `fn` as one device would, with its heads (Pallas kernels included); `fn` must
    close over no traced arrays (`shard_map` cannot split those): they go in `shared`."""
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=(HEADS,) * num_split + (PartitionSpec(),), out_specs=HEADS,
                         check_vma=False)
