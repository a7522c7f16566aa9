"""Prefix caching for hybrid targets: saved gated-delta-net states beside the cached pages.

A hybrid target's layers carry a recurrent state that the KV pages of a prefix cannot
rebuild, so a request may start from a cached prefix only at a position where that state
was saved. A prefill chunk that ends at a saving boundary (every `interval` tokens, and the
last full page of the prompt) writes its row's state into a slot of a device pool under the
key of the page that ends there (`prefix_cache`'s hash chain: the state after a prefix
depends on its tokens only). An admitted request then starts from the deepest of its cached
pages whose key has a saved state, which its first chunk reads in place of its slot's.

Saved states are kept least recently used first out; one that an admitted request is still
to read, or a step is still to write, is pinned until that step is launched (steps run in
launch order, so a later overwrite lands after that read or write).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from dflash_jax.config_types import TargetConfig

# Tokens between saving boundaries (rounded to pages): a shared system prompt is found at
# the last multiple of it inside, a conversation's earlier turn at its last full page.
SAVE_INTERVAL = 512


class SavedStates:
    """Which key's state each slot of the device pool holds."""

    def __init__(self, capacity: int, interval: int):
        if capacity < 1:
            raise ValueError(f"saved states need a capacity of at least 1, got {capacity}.")
        self.capacity, self.interval = capacity, interval
        self._slot_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._unpinned: OrderedDict[int, None] = OrderedDict()  # saved slots no one is to read, oldest first
        self._pins: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    @classmethod
    def for_target(cls, cfg: TargetConfig, max_num_reqs: int, page_size: int) -> SavedStates | None:
        """A hybrid target's saved states, as many as it has request slots (so their memory
        equals the slots' own states); None for a target without recurrent layers."""
        if cfg.linear_attention is None:
            return None
        return cls(max_num_reqs, max(1, SAVE_INTERVAL // page_size) * page_size)

    def next_boundary(self, start: int, end: int, last: int) -> int | None:
        """The first saving boundary in (start, end]: a multiple of `interval` up to `last`,
        or `last` (the end of the prompt's last full page before its last position)."""
        every = (start // self.interval + 1) * self.interval
        candidates = [b for b in (every, last) if start < b <= min(end, last)]
        return min(candidates) if candidates else None

    def deepest(self, keys: Sequence[bytes]) -> tuple[int, int] | None:
        """(pages, pool slot) of the longest run of `keys` whose last key has a saved state,
        the slot pinned; None without any."""
        for depth in range(len(keys), 0, -1):
            slot = self._slot_of.get(keys[depth - 1])
            if slot is not None:
                self._unpinned.pop(slot, None)
                self._pins[slot] = self._pins.get(slot, 0) + 1
                return depth, slot
        return None

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]
            if slot in self._key_of:
                self._unpinned[slot] = None

    def claim(self, key: bytes) -> int | None:
        """A pool slot to save the state under `key` into, now findable by it and pinned (the
        caller unpins it once the saving step is launched); None when the key is saved already
        or every slot is pinned."""
        if key in self._slot_of:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._unpinned:
            slot, _ = self._unpinned.popitem(last=False)
            del self._slot_of[self._key_of.pop(slot)]
        else:
            return None
        self._slot_of[key], self._key_of[slot] = slot, key
        self._pins[slot] = 1  # until the step saving into it is launched: no other save may take it first
        return slot
