"""Automatic prefix caching: full KV pages kept for reuse by later requests with the same
prefix, as vLLM and SGLang do, and the drafter's context with them.

A page is found by the hash chain of its tokens: page i's key digests page i - 1's key and
page i's tokens, so a key stands for every token up to the page's end, which is all the
target's K/V at those positions depends on. The drafter's context K/V of a position depends
only on the target's features there, and the drafter's caches share the target's page table
while prefix caching is on (windowed drafter layers included), so one page holds both: a hit
restores the target's K/V and the drafter's context alike.

Pages are shared by reference count. A page is published once every position in it is
computed by a launched step (steps run on the device in launch order, so a request that
finds it reads it after it is written); no request writes a published page again, since a
request writes only positions past what it has computed. A page no request holds stays
findable until the allocator needs it for another, least recently released first.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from dflash_jax.kv_cache import OutOfPages, PageAllocator


def extend_page_keys(keys: list[bytes], tokens: Sequence[int], page_size: int, num_pages: int) -> list[bytes]:
    """`keys` (the chain of a sequence's first pages) extended in place to its first
    `num_pages` pages of `tokens`; returns it."""
    if len(tokens) < num_pages * page_size:
        raise ValueError(f"{len(tokens)} tokens do not fill {num_pages} pages of {page_size}.")
    for index in range(len(keys), num_pages):
        page_tokens = np.asarray(tokens[index * page_size : (index + 1) * page_size], np.int32)
        parent = keys[-1] if keys else b""
        keys.append(hashlib.blake2b(parent + page_tokens.tobytes(), digest_size=16).digest())
    return keys


@dataclasses.dataclass
class PrefixCacheStats:
    """Prompt tokens looked up at admission and those found cached (vLLM's
    `prefix_cache_queries` and `prefix_cache_hits`)."""

    queries: int = 0
    hits: int = 0


class PrefixCache(PageAllocator):
    """A page allocator whose pages are shared by reference count and, once published under
    a key, found again by it until they are needed for something else."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self._refs: dict[int, int] = {}  # pages held, by how many requests
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._unheld: OrderedDict[int, None] = OrderedDict()  # published pages no request holds, oldest first
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        """Pages a request may take: free ones and published ones no request holds."""
        return len(self._free) + len(self._unheld)

    @property
    def num_cached(self) -> int:
        """Published pages, held or not."""
        return len(self._key_of)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPages(f"need {count} pages, {self.num_free} free")
        while len(self._free) < count:
            page, _ = self._unheld.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            super().free([page])
        pages = super().allocate(count)
        self._refs.update((page, 1) for page in pages)
        return pages

    def free(self, pages: list[int]) -> None:
        """Release one reference to each page; a request's last pages are let go first."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if page in self._key_of:
                self._unheld[page] = None
            else:
                super().free([page])

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The published pages of the longest run of `keys` from the first, each now held once more."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self._unheld.pop(page, None)
            self._refs[page] = self._refs.get(page, 0) + 1
            pages.append(page)
        return pages

    def publish(self, page: int, key: bytes) -> None:
        """Make a held page findable by `key`, unless another page already is (then this one
        stays private and is freed as usual)."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key
