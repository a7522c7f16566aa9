"""The Engine's compiled step programs: one jitted step per (model structures, cycle
configuration, most cycles per step, platform), shared by every Engine of those models, and
its executables compiled ahead of time from argument shapes, once each even when two threads
ask at the same time (a server compiles in the background while it steps).

A step runs up to `max_cycles` verify cycles over one batch (`cycle.speculative_cycle` in a
loop that ends on the device once no row has tokens left) and returns each cycle's committed
tokens packed into one int32 array, for one transfer to the host.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflash_jax.cycle import CycleConfig, fill_verify_rows, speculative_cycle
from dflash_jax.flat_models import unflatten_models
from dflash_jax.sampling import MAX_TOP_LOGPROBS
from dflash_jax.sharding import replicated
from dflash_jax.step_inputs import unpack

# Traces of the step program; a test asserts that a warmed-up engine adds none.
_traces = [0]


def num_traces() -> int:
    """How many step programs have been traced (compiled) in this process."""
    return _traces[0]


def shape_of(array, sharding=None) -> jax.ShapeDtypeStruct:
    """`array`'s shape, dtype and placement (`sharding` for a host array about to be sent there)."""
    return jax.ShapeDtypeStruct(array.shape, array.dtype, weak_type=getattr(array, "weak_type", False),
                                sharding=getattr(array, "sharding", sharding))


class HashedOnce:
    """A key hashed once: the argument shapes of a large model are hundreds of leaves, and
    hashing them anew would add to every step's program lookup on the host."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, HashedOnce) and self._hash == other._hash
                                 and self.value == other.value)


class Executables:
    """The compiled step programs of one jitted step, by (argument shapes, static layout,
    greedy); each compiled once even when two threads ask for it at the same time."""

    def __init__(self, jitted, compiler_options: dict):
        self.jitted = jitted
        self.compiler_options = compiler_options
        self.compiled: dict = {}
        self._canonical: dict = {}
        self._locks: dict = {}
        self._locks_lock = threading.Lock()

    def canonical(self, key: HashedOnce) -> HashedOnce:
        """The one object standing for `key`'s value here: engines of the same models and
        sizes then find their programs by identity, without comparing every leaf's shape."""
        return self._canonical.setdefault(key, key)

    def get(self, key, shapes: Callable[[], tuple]):
        """The executable for `key`, compiled from the argument shapes `shapes()` if new."""
        executable = self.compiled.get(key)
        if executable is not None:
            return executable
        with self._locks_lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self.compiled:
                self.compiled[key] = self.jitted.lower(*shapes()).compile(self.compiler_options or None)
        return self.compiled[key]


@functools.lru_cache(maxsize=None)
def executables(treedefs, cfg: CycleConfig, max_cycles: int, platform: str) -> Executables:
    """The step of engines with these models' structures, cycle configuration and most
    cycles per step on `platform`, made once per (treedefs, cfg, max_cycles, platform):
    engines of one model share its compiled programs. Each program is compiled ahead of time
    from argument shapes (`Engine.precompile` may run on another thread than the steps).
    Parameters travel as flat lists of arrays (`flat_models`): no graph hashing or pytree
    flattening per step."""

    def step(param_leaves, state, buffer, layout, greedy, logprobs, adjusts_logits, penalizes):
        _traces[0] += 1
        models = unflatten_models(treedefs, param_leaves)
        batch, cycles = unpack(buffer, layout)
        tables = batch.draft_page_tables  # drafter groups without pages of their own share the target's
        tables += tables[:1] * (len(state.draft_caches) - len(tables))
        batch = dataclasses.replace(batch, draft_page_tables=tables)
        cycle_cfg = dataclasses.replace(cfg, greedy=greedy, logprobs=logprobs, adjusts_logits=adjusts_logits,
                                        penalizes=penalizes)
        samples_R = batch.remaining_R > 0
        mesh = models[0].mesh
        # The drafter's stacked context K/V weights, built once for the step's cycles
        context_weights = models[1].context_kv_weights() if cfg.num_drafts else None

        def cycle(state, stopped_R):
            """One verify cycle; rows stopped in an earlier cycle of this step commit nothing.
            Also whether any row has tokens left to commit after it."""
            with jax.named_scope("fill_verify_rows"):
                rows = fill_verify_rows(batch, state)
                remaining_R = jnp.where(samples_R & ~stopped_R, batch.last_pos_R - rows.anchor_pos_R, 0)
            state, committed = speculative_cycle(models, state, dataclasses.replace(rows, remaining_R=remaining_R),
                                                 cycle_cfg, context_weights=context_weights)
            # The donated state comes back placed as it went in (see Engine._whole).
            state = dataclasses.replace(state, **{name: replicated(getattr(state, name), mesh) for name in (
                "drafts_SN", "draft_probs_SNV", "anchor_S", "anchor_pos_S", "output_counts_SV",
                "prompt_seen_SV")})
            packed = pack(committed)
            stopped_R = stopped_R | committed.stopped_R
            going = jnp.any(~stopped_R & (remaining_R - committed.count_R > 0))
            return state, stopped_R, packed, going

        not_stopped_R = jnp.zeros(samples_R.shape, bool)
        if max_cycles == 1:
            state, _, packed, _ = cycle(state, not_stopped_R)
            return state, packed[None]

        def body(carry):
            i, state, stopped_R, _, packed_by_cycle = carry
            state, stopped_R, packed, going = cycle(state, stopped_R)
            return i + 1, state, stopped_R, going, packed_by_cycle.at[i].set(packed)

        # Cycles left unrun (every row ended) read as committing nothing.
        num_rows, num_query = batch.verify_rows_RQ.shape
        num_top = min(MAX_TOP_LOGPROBS, models[0].cfg.vocab_size)
        packed_by_cycle = jnp.zeros((max_cycles, num_rows, packed_width(num_query, logprobs, num_top)), jnp.int32)
        carry = (jnp.int32(0), state, not_stopped_R, jnp.bool_(True), packed_by_cycle)
        _, state, _, _, packed_by_cycle = jax.lax.while_loop(lambda c: (c[0] < cycles) & c[3], body, carry)
        return state, packed_by_cycle

    return Executables(jax.jit(step, donate_argnums=1, static_argnums=(3, 4, 5, 6, 7)),
                        STEP_COMPILER_OPTIONS.get(platform, {}))


def pack(committed) -> jax.Array:
    """int32 [R, `packed_width`]: per row its tokens, count and stopped flag, then with
    log-probabilities each token's, the top ids and the top log-probabilities (floats as
    their bits)."""
    parts = [committed.tokens_RQ, committed.count_R[:, None], committed.stopped_R[:, None].astype(jnp.int32)]
    if committed.logprobs is not None:
        logprob_RQ, top_ids_RQJ, top_logprobs_RQJ = committed.logprobs
        num_rows = logprob_RQ.shape[0]
        parts += [jax.lax.bitcast_convert_type(logprob_RQ, jnp.int32), top_ids_RQJ.reshape(num_rows, -1),
                  jax.lax.bitcast_convert_type(top_logprobs_RQJ, jnp.int32).reshape(num_rows, -1)]
    return jnp.concatenate(parts, axis=1)


def packed_width(num_query: int, logprobs: bool, num_top: int) -> int:
    """`pack`'s row width; `num_top`: the top log-probabilities per token."""
    return num_query + 2 + (num_query * (1 + 2 * num_top) if logprobs else 0)


def unpack_committed(packed_R, num_query: int, logprobs: bool):
    """(tokens_RQ, count_R, stopped_R, logprobs or None) of one cycle's packed host array;
    logprobs as `Committed.logprobs` (numpy)."""
    tokens_RQ, count_R, stopped_R = packed_R[:, :num_query], packed_R[:, num_query], packed_R[:, num_query + 1]
    if not logprobs:
        return tokens_RQ, count_R, stopped_R, None
    rest = packed_R[:, num_query + 2 :]
    num_rows, num_top = rest.shape[0], (rest.shape[1] // num_query - 1) // 2
    logprob_RQ = rest[:, :num_query].view(np.float32)
    top_ids_RQJ = rest[:, num_query : num_query * (1 + num_top)].reshape(num_rows, num_query, num_top)
    top_logprobs_RQJ = rest[:, num_query * (1 + num_top) :].view(np.float32).reshape(num_rows, num_query, num_top)
    return tokens_RQ, count_R, stopped_R, (logprob_RQ, top_ids_RQJ, top_logprobs_RQJ)


def default_cycles_per_step(mesh: Mesh | None = None) -> int:
    """Verify cycles per step where none are asked for: 4 on an accelerator, whose cycles
    of a small model take about as long as the host's work for a step, and 1 on a CPU,
    whose cycles take far longer (more would only make new requests wait)."""
    return 1 if platform_of(mesh) == "cpu" else 4


def platform_of(mesh: Mesh | None) -> str:
    """The platform the Engine's programs run on: its mesh's, else the default backend's."""
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


# XLA options of the step programs per platform. On a GPU, XLA runs a loop's iterations by
# reading its condition back on the host, which holds the host in the step's launch for all
# of its cycles; with the loop and its conditionals inside CUDA graphs (command buffers) the
# device runs them alone and the launch returns at once.
STEP_COMPILER_OPTIONS = {
    "gpu": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"},
}


def clear_compiled_programs() -> None:
    """Forget the step programs compiled for Engines (engines alive keep theirs), as
    `jax.clear_caches()` does for jitted functions, which does not reach these: a process
    that builds engines for many models otherwise keeps every executable it compiled."""
    executables.cache_clear()
