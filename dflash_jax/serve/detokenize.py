"""Generated token ids to text, piece by piece, with stop strings matched on the text.

Each push decodes every id generated so far and emits what is new. Decoding the whole
sequence, not each token alone, keeps multi-token characters and the tokenizer's spacing
right. Two kinds of text are held back until later tokens settle them: a trailing U+FFFD
(the first bytes of a character whose remaining bytes are still to come) and a tail that
could be the start of a stop string.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one request's generated ids; `stopped` once a stop string appears."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), min_tokens: int = 0):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._min_tokens = min_tokens  # vLLM's: a stop string counts only once it ends in a token past these
        self._floor: int | None = None  # the length of the first min_tokens - 1 ids' text, once known
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already handed out
        self.text = ""  # everything handed out
        self.stopped = False
        # Generated tokens that the text covers: all of them, or once a stop string appears
        # those up to the one that completed it (a step may bring tokens past it).
        self.num_tokens = 0

    def push(self, new_ids: Sequence[int]) -> str:
        """The text that `new_ids` make certain (possibly empty)."""
        if self.stopped:
            return ""
        before = len(self._ids)
        self._ids.extend(new_ids)
        full = self._decode(self._ids)
        cut = self._find_stop(full, len(self._ids))
        if cut is not None:
            self.stopped = True
            self.num_tokens = self._tokens_through_stop(before)
            return self._emit(full, cut)
        self.num_tokens = len(self._ids)
        end = len(full)
        while end > self._emitted and full[end - 1] == REPLACEMENT:
            end -= 1
        end -= self._stop_prefix_len(full[:end])
        return self._emit(full, end)

    def flush(self) -> str:
        """At the end of generation: everything held back (no later token can change it)."""
        if self.stopped:
            return ""
        return self._emit(self._decode(self._ids), None)

    def _tokens_through_stop(self, before: int) -> int:
        """The fewest ids, more than `before`, whose text holds a stop string."""
        for count in range(before + 1, len(self._ids)):
            if self._find_stop(self._decode(self._ids[:count]), count) is not None:
                return count
        return len(self._ids)

    def _emit(self, full: str, end: int | None) -> str:
        end = len(full) if end is None else end
        delta = full[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        self.text += delta
        return delta

    def _find_stop(self, full: str, num_ids: int) -> int | None:
        """Where the stop string that is complete first (the one ending first, as token by
        token generation meets them) starts in text not yet handed out, if any. Not the one
        starting first: a longer stop may start earlier and end later, and the text must not
        depend on how many tokens a step brought. `full`: the text of the first `num_ids` ids;
        a stop ending within the first `min_tokens` - 1 ids' text does not count."""
        if not self._stop or num_ids < self._min_tokens:
            return None
        # A stop string may begin in held-back text just before the emitted point.
        start = max(self._emitted - max(len(s) for s in self._stop) + 1, 0)
        if self._floor is None:  # the text of the first min_tokens - 1 ids: fixed once they are in
            self._floor = len(self._decode(self._ids[: self._min_tokens - 1])) if self._min_tokens > 1 else 0
        floor = self._floor
        hits = []
        for stop in self._stop:
            at = full.find(stop, start)
            while at >= 0 and at + len(stop) <= floor:
                at = full.find(stop, at + 1)
            if at >= 0:
                hits.append((at + len(stop), at))
        return min(hits)[1] if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
