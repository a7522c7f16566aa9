"""Paged KV caches (device arrays) and the host-side page allocator.

A cache holds, per layer, keys and values as flat slot arrays `[num_pages * page_size, K, H]`
(of the values' dtype, or of their bits: `storage_dtype`):
slot `page * page_size + offset` holds one token. A request's page table row lists its
pages; position p lives at slot `page_table[p // page_size] * page_size + p % page_size`.
Page 0 is the null page: never handed out, so block-table padding points at it harmlessly.
Writes go through slot mappings where a negative slot (the pad slot) writes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels import Kernels
from dflash_jax.sharding import kv_cache_sharding
from pallas_kernels.common import stored_as_bits
from pallas_kernels.finish_heads import write_slots


NULL_PAGE = 0
PAD_SLOT = -1


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["page_size"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Per-layer key and value slot arrays, each `[num_slots, num_kv_heads, head_dim]`."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_size: int

    @classmethod
    def zeros(cls, *, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, sharding=None):
        """Zeroed slot arrays, born in `sharding` (None: the default device)."""
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
            page_size=page_size,
        )

    @classmethod
    def for_model(cls, model, num_layers: int, num_pages: int, page_size: int, kernels: Kernels) -> PagedKVCache:
        """A zeroed cache for `num_layers` layers shaped like `model`'s attention, split by kv
        head over the model's mesh if it has one (`sharding.kv_cache_sharding`), stored as
        `kernels` read and write it best (`storage_dtype`)."""
        return cls.zeros(
            num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            num_kv_heads=model.cfg.num_kv_heads, head_dim=model.cfg.head_dim,
            dtype=storage_dtype(model.dtype, kernels), sharding=kv_cache_sharding(model.mesh),
        )

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    def write(self, layer: int, slots_T, k_TKH, v_TKH) -> PagedKVCache:
        """Scatter one layer's new K/V rows to their slots; pad slots (< 0) are dropped."""
        return self.with_layer(layer, write_slots(self.k[layer], slots_T, k_TKH),
                                write_slots(self.v[layer], slots_T, v_TKH))

    def with_layer(self, layer: int, k, v) -> PagedKVCache:
        return dataclasses.replace(
            self,
            k=self.k[:layer] + (k,) + self.k[layer + 1 :],
            v=self.v[:layer] + (v,) + self.v[layer + 1 :],
        )


def storage_dtype(dtype, kernels: Kernels) -> jnp.dtype:
    """The dtype a cache of `dtype` values is stored in: their bits
    (`pallas_kernels.common.stored_as_bits`) for 16-bit floats that only the jnp references
    read and write on a CPU, so that a step writes its rows in place rather than copying
    every layer's cache; the values' own dtype otherwise (the Pallas kernels' form)."""
    kernels = kernels.resolve()
    references_only = kernels.heads == kernels.attention == "reference"
    if references_only and jnp.dtype(dtype).itemsize == 2 and jax.default_backend() == "cpu":
        return stored_as_bits(dtype)
    return jnp.dtype(dtype)


def kv_cache_bytes(*, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype) -> int:
    return 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def pages_within(budget: int, page_bytes: int, state_bytes: int) -> int:
    """KV pages (at least 2) a `kv_cache_memory_bytes` budget holds beside `state_bytes` of
    per-request state (a hybrid target's recurrent states), which it must hold first."""
    if state_bytes >= budget:
        raise ValueError(f"kv_cache_memory_bytes={budget} cannot hold the target's recurrent states "
                         f"({state_bytes} bytes); raise it or lower max_num_reqs.")
    return max(2, (budget - state_bytes) // page_bytes)


def free_memory_bytes(mesh=None) -> int:
    """Bytes free for caches on the devices the models use (every device of `mesh`, else the
    default device), as the devices report them (limit less what is in use, after the models
    were placed); on a CPU, the host's available memory."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if all(device.platform == "cpu" for device in devices):
        return _host_available_bytes()
    free = 0
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"{device} does not report its memory; size the KV cache by page count instead.")
        free += stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return free


def _host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (free memory plus what the kernel can reclaim), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def slots_of(page_table, positions, page_size: int, rows=None):
    """Slot of each position through its page table row: `page_table` [..., pages_per_req] and
    `positions` [..., n] with the same leading shape; or, for ragged tokens, `page_table`
    [R, pages_per_req] and `rows` [T], each token's row. numpy on the host, jax on the device."""
    if rows is not None:
        pages = page_table[rows, positions // page_size]
    else:
        xp = np if isinstance(page_table, np.ndarray) else jnp
        pages = xp.take_along_axis(page_table, positions // page_size, axis=-1)
    return pages * page_size + positions % page_size


@dataclasses.dataclass(frozen=True)
class DraftCacheGroups:
    """The drafter's KV-cache groups, one per attention kind (as vLLM groups them).

    Group 0 holds the unwindowed layers and shares the target's pages and page table; each
    other group holds the layers of one window W, with its own pages, so pages that fell out
    of the window can be given back. `layers[g]` lists the drafter layers of group g.
    """

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def for_drafter(cls, cfg) -> DraftCacheGroups:
        layer_windows = tuple(rule.window for rule in cfg.layers)
        windows = (None,) + tuple(sorted({w for w in layer_windows if w is not None}))
        layers = tuple(tuple(i for i, w in enumerate(layer_windows) if w == window) for window in windows)
        return cls(windows, layers)

    def group_of(self, layer: int) -> tuple[int, int]:
        """(group, index of the layer inside its group's cache)."""
        for group, members in enumerate(self.layers):
            if layer in members:
                return group, members.index(layer)
        raise IndexError(layer)


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request; the engine preempts or refuses."""


class PageAllocator:
    """Host-side free list of page ids 1..num_pages-1 (page 0 is the null page)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}.")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"need {count} pages, {len(self._free)} free")
        pages = self._free[len(self._free) - count :][::-1]
        del self._free[len(self._free) - count :]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
