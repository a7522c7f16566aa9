"""The drafter training set on disk, and fixed-shape batches from it.

One `.npz` file: `token_ids` (int32, all sequences concatenated), `loss_mask` (bool, same
length: on for response tokens, the ones the drafter learns to predict), `offsets` (int64
[N+1], sequence n is `offsets[n]:offsets[n+1]`) and `meta` (a JSON string: where the data came
from, for the model card). Plain numpy: no pickle, loads anywhere.

Batches are always [batch_size, max_length] (one compiled step): sequences are cut at
max_length, short ones padded with loss mask off, and the last batch of an epoch is filled with
empty rows. The order is a permutation drawn from (seed, epoch), so step s always sees the same
batch and a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np


def save_dataset(
    path: str | Path, sequences: Sequence[tuple[Sequence[int], Sequence[bool]]], meta: dict[str, Any]
) -> Path:
    """Write (token ids, loss mask) pairs to `path` (.npz)."""
    if not sequences:
        raise ValueError("no sequences to save; the prompt source produced nothing.")
    for ids, mask in sequences:
        if len(ids) != len(mask):
            raise ValueError(f"a sequence has {len(ids)} tokens but {len(mask)} loss-mask entries.")
    lengths = [len(ids) for ids, _ in sequences]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(
            f,
            token_ids=np.concatenate([np.asarray(ids, np.int32) for ids, _ in sequences]),
            loss_mask=np.concatenate([np.asarray(mask, bool) for _, mask in sequences]),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            meta=np.array(json.dumps(meta)),
        )
    return path


class DrafterDataset:
    """Sequences of one or more saved training sets (e.g. shards built on several devices),
    served as fixed-shape padded batches."""

    def __init__(self, paths: str | Path | Sequence[str | Path]):
        paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
        if not paths:
            raise ValueError("no training set given; build one with `dflash-jax build-drafter-data`.")
        parts = [_load_part(path) for path in paths]
        self.token_ids = np.concatenate([p["token_ids"] for p in parts])
        self.loss_mask = np.concatenate([p["loss_mask"] for p in parts])
        starts = np.cumsum([0] + [len(p["token_ids"]) for p in parts[:-1]])
        self.offsets = np.concatenate([[0]] + [p["offsets"][1:] + s for p, s in zip(parts, starts)])
        self.meta = parts[0]["meta"] if len(parts) == 1 else {"parts": [p["meta"] for p in parts]}

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def steps_per_epoch(self, batch_size: int) -> int:
        return -(-len(self) // batch_size)

    def batch(self, step: int, batch_size: int, max_length: int, seed: int):
        """(token_ids int32 [batch_size, max_length], loss_mask bool [same]) for `step`."""
        epoch, index = divmod(step, self.steps_per_epoch(batch_size))
        order = np.random.default_rng([seed, epoch]).permutation(len(self))
        rows = order[index * batch_size : (index + 1) * batch_size]
        token_ids = np.zeros((batch_size, max_length), np.int32)
        loss_mask = np.zeros((batch_size, max_length), bool)
        for row, n in enumerate(rows):
            start = self.offsets[n]
            end = min(self.offsets[n + 1], start + max_length)
            token_ids[row, : end - start] = self.token_ids[start:end]
            loss_mask[row, : end - start] = self.loss_mask[start:end]
        return token_ids, loss_mask


def _load_part(path: Path) -> dict[str, Any]:
    """One saved training set as arrays, checked."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; build it with `dflash-jax build-drafter-data`.")
    try:
        with np.load(path) as data:
            missing = {"token_ids", "loss_mask", "offsets"} - set(data.files)
            if missing:
                raise ValueError(f"{path} lacks {sorted(missing)}; it is not a drafter training set.")
            part = {
                "token_ids": data["token_ids"].astype(np.int32),
                "loss_mask": data["loss_mask"].astype(bool),
                "offsets": data["offsets"].astype(np.int64),
                "meta": json.loads(str(data["meta"])) if "meta" in data.files else {},
            }
    except (OSError, EOFError, zipfile.BadZipFile, ValueError, AttributeError) as err:
        if isinstance(err, ValueError) and str(err).startswith(str(path)):
            raise
        raise ValueError(
            f"{path} is not a readable drafter training set ({type(err).__name__}); build it again with "
            "`dflash-jax build-drafter-data`."
        ) from err
    if len(part["offsets"]) < 2:
        raise ValueError(f"{path} holds no sequences.")
    return part
