"""README.md for an exported drafter: what it was trained on and how, for whoever loads it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


def write_model_card(export_dir: str | Path, result, hp, data_meta: dict[str, Any], **run: Any) -> Path:
    """Write `export_dir/README.md` from the run's settings, data provenance and final metrics."""
    path = Path(export_dir) / "README.md"
    path.write_text(model_card_text(result, hp, data_meta, **run))
    return path


def model_card_text(result, hp, data_meta: dict[str, Any], **run: Any) -> str:
    """The README.md of `write_model_card`, as text (the train CLI writes it with the export)."""
    cfg = result.drafter.cfg
    accuracy = " ".join(f"{a:.3f}" for a in result.accuracy)
    text = f"""---
library_name: dflash-jax
tags: [dflash, speculative-decoding, drafter]
---

# {"DFlash 2" if cfg.dflash2 else "DFlash-1"} drafter (trained with dflash-jax)

A block drafter for speculative decoding (DFlash, arXiv:2602.06036) in z-lab's
{"DFlash2DraftModel" if cfg.dflash2 else "DFlash-1"} format: `config.json` with `dflash_config`,
weights in safetensors (bf16, sharded when large). It has no embedding or LM head of its own:
load it next to its target.
{_dflash2_section(cfg.dflash2)}
- target: `{run.get('target')}`
- drafter: {cfg.num_layers} layers, hidden {cfg.hidden_size}, block size {cfg.trained_block_size},
  mask token {cfg.mask_token_id}, target layers {list(cfg.target_layer_ids)}
- data{f": `{run['data']}`" if run.get('data') else ""}
```json
{json.dumps(data_meta, indent=2)}
```
{f"- started from: {run['init']}" + chr(10) if run.get('init') else ""}- steps: {result.steps_done}, batch {run.get('batch_size')} sequences, max length {run.get('max_length')}
- hyperparameters:
```json
{json.dumps(dataclasses.asdict(hp), indent=2)}
```
- final training loss {result.losses[-1] if result.losses else float('nan'):.4f}; per-slot accuracy
  (slots 1..{cfg.trained_block_size - 1}) on the last batch: {accuracy}
"""
    return text


def _dflash2_section(dflash2) -> str:
    """What a DFlash 2 drafter adds, and the training choices no published recipe fixed."""
    if dflash2 is None:
        return ""
    return f"""
DFlash 2: a causal convolution around every attention and MLP sublayer ({dflash2.conv_kernel_size}
taps, a predicted kernel per {dflash2.conv_group_size} channels) and a candidate selector over each
position's {dflash2.selector_top_k} best logits (codebooks of rank {dflash2.selector_rank}).
Training choices made here: the selector's loss is teacher-forced cross-entropy over the K
candidates (the true previous token as predecessor, the true token as label, slots where it is
not among the candidates left out), with the drafter's slot weights, added to the drafter's
loss with `selector_weight`; gradients reach the logits through the candidates' scores. A
drafter grown from a DFlash-1 one starts with convolutions that pass their input through and a
zero pairing term, so it drafts as the DFlash-1 drafter until trained.
"""


def append_acceptance(export_dir: str | Path, acceptance: dict[str, float], setting: str) -> Path:
    """Add a held-out acceptance table to the card; keys look like `b16_t0.0` (block size, temperature)."""
    rows = []
    for key, tau in acceptance.items():
        block, temperature = key[1:].split("_t")
        rows.append(f"| {block} | {temperature} | {tau:.3f} |")
    path = Path(export_dir) / "README.md"
    with path.open("a") as card:
        card.write(
            f"\n## Held-out acceptance\n\nMean accepted length (tokens committed per draft-verify cycle, "
            f"the target's bonus token included) on {setting}:\n\n| block size | temperature | mean accepted length |\n"
            "|---|---|---|\n" + "\n".join(rows) + "\n"
        )
    return path
