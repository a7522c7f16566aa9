"""The training loop: batches, the jitted step, orbax checkpoints to resume, a progress bar.

Checkpoints (float32 master params + optimizer state, keyed by step) go to
`work_dir/checkpoints`; a run started again with the same work_dir resumes from the latest,
and because batches and anchors are keyed by step the resumed run matches an unbroken one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from dflash_jax.config import check_drafter_fits_target
from dflash_jax.models import Drafter, Target, model_from_params, model_in_dtype
from dflash_jax.quantization import params_of
from dflash_jax.sharding import DATA
from dflash_jax.staging import write_text_atomically
from dflash_jax.train.data import DrafterDataset
from dflash_jax.train.step import Hyperparams, drafter_params, make_train_step


@dataclasses.dataclass
class TrainResult:
    drafter: Drafter  # float32, trained
    losses: list[float]  # per step run in this call
    accuracy: np.ndarray  # per-slot accuracy of the last step, [B-1]
    steps_done: int


def train_drafter(
    target: Target,
    drafter: Drafter,
    dataset: DrafterDataset,
    hp: Hyperparams,
    work_dir: str | Path,
    *,
    batch_size: int,
    max_length: int,
    checkpoint_every: int = 1000,
    progress: bool = True,
    time_budget_s: float | None = None,
    mesh: Mesh | None = None,
) -> TrainResult:
    """Train `drafter` against the frozen `target` for `hp.total_steps` steps (resuming).

    `mesh` (`sharding.make_mesh(1)`: every device): data-parallel over its "data" axis, each
    step's batch split over the devices (`batch_size` must divide by their number).

    With `time_budget_s`, stop after the first step that ends past the budget and checkpoint
    there: a later call with the same work_dir carries on (`steps_done` says how far it got).
    """
    check_drafter_fits_target(target.cfg, drafter.cfg)
    if hp.frozen_backbone and drafter.cfg.dflash2 is None:
        raise ValueError("a frozen backbone trains a DFlash 2 drafter's convolutions and selector alone; this "
                         "drafter is DFlash-1, so nothing would train.")
    if max_length < drafter.cfg.trained_block_size:
        raise ValueError(f"max_length {max_length} is shorter than the block size {drafter.cfg.trained_block_size}.")
    if mesh is not None and batch_size % mesh.shape[DATA]:
        raise ValueError(f"batch_size {batch_size} must divide by the {mesh.shape[DATA]} data-parallel devices.")
    cfg = drafter.cfg
    target = _cast(target, hp.compute_dtype)
    target_graph, target_state = nnx.split(target)
    optimizer, step_fn = make_train_step(cfg, target_graph, hp, mesh)
    params = drafter_params(drafter)
    opt_state = optimizer.init(params)

    manager = ocp.CheckpointManager(
        Path(work_dir, "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    start = manager.latest_step() or 0
    try:
        _check_trained_parts(Path(work_dir, TRAINED_PARTS), hp, resuming=bool(start))
    except ValueError:
        manager.close()
        raise
    if start:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        restored = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        params, opt_state = restored["params"], restored["opt_state"]
    if mesh is not None:  # whole on every device; each step splits its batch
        params, opt_state, target_state = jax.device_put((params, opt_state, target_state),
                                                         NamedSharding(mesh, PartitionSpec()))

    losses, accuracy = [], np.zeros(cfg.trained_block_size - 1)
    deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
    done = start
    bar = tqdm(range(start, hp.total_steps), initial=start, total=hp.total_steps, disable=not progress, desc="train")
    try:
        for step in bar:
            token_ids, loss_mask = dataset.batch(step, batch_size, max_length, hp.seed)
            params, opt_state, metrics = step_fn(params, opt_state, target_state, token_ids, loss_mask, step)
            losses.append(float(metrics["loss"]))
            if not math.isfinite(losses[-1]):
                raise NonFiniteLossError(_diverged(f"the training loss is {losses[-1]} at step {step + 1}",
                                                   manager.latest_step() or 0))
            accuracy = np.asarray(metrics["accuracy"])
            selector = f"selector {float(metrics['selector_loss']):.3f} " if "selector_loss" in metrics else ""
            bar.set_postfix_str(
                f"loss {losses[-1]:.3f} {selector}lr {float(metrics['learning_rate']):.2e} "
                f"acc {' '.join(f'{a:.2f}' for a in accuracy[:8])}"
            )
            done = step + 1
            out_of_time = deadline is not None and time.monotonic() > deadline
            if done % checkpoint_every == 0 or done == hp.total_steps or out_of_time:
                if not _all_finite(params):  # a step can leave NaN weights behind a finite loss
                    raise NonFiniteLossError(_diverged(f"the drafter's weights are not finite after step {done}",
                                                       manager.latest_step() or 0))
                manager.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            if out_of_time:
                break
    finally:  # an interrupted run still leaves its last checkpoint complete
        manager.wait_until_finished()
        manager.close()
    trained = model_from_params(cfg, jnp.float32, params)
    return TrainResult(trained, losses, accuracy, done)


TRAINED_PARTS = "trained_parts.json"  # beside the checkpoints: what the first run trained


def _check_trained_parts(record: Path, hp: Hyperparams, *, resuming: bool) -> None:
    """A resumed run trains what the first run trained: the checkpoints' optimizer state fits
    either choice, so a resume that dropped or added `frozen_backbone` would go on silently."""
    parts = {"frozen_backbone": hp.frozen_backbone}
    if resuming and record.is_file():
        try:
            saved = json.loads(record.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{record} is damaged; delete it to resume as this run is set, or choose another "
                             "OUT.") from None
        if saved.get("frozen_backbone") != hp.frozen_backbone:
            flag = "with" if saved.get("frozen_backbone") else "without"
            raise ValueError(f"the checkpoints in {record.parent} were trained {flag} --frozen-backbone; resume "
                             f"{flag} it, or choose another OUT.")
        return
    record.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(record, json.dumps(parts))


class NonFiniteLossError(ValueError):
    """Training diverged (NaN or inf); nothing of the diverged steps is saved or exported."""


def _diverged(what: str, last_saved: int) -> str:
    kept = f"checkpoints up to step {last_saved} are kept" if last_saved else "no checkpoint was written"
    return (f"{what}; training stopped and nothing was exported ({kept}). Lower --lr or --grad-clip, "
            "or check the training data.")


def _all_finite(params) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def _cast(model, dtype):
    """The frozen model rebuilt in the compute dtype (layers compute in their own dtype; 8-bit
    weights and their scales stay)."""
    return model_in_dtype(model.cfg, jnp.dtype(dtype), params_of(model))
