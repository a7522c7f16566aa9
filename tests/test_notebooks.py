"""Every notebook under notebooks/ executes top to bottom without an error, and is stored
without outputs (they are produced by running it, not kept in git)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import FAST_COMPILE_FLAGS
from dflash_jax.demo import DEFAULT_DRAFTER

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# These run SmolLM2-135M with its trained drafter: the one shipped in DEFAULT_DRAFTER, or the
# folder DFLASH_JAX_DRAFTER names.
NEED_SMOLLM2_DRAFTER = {"01_quickstart.ipynb", "03_acceptance.ipynb"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    # The notebooks decode a real model: its run, not compilation, dominates them, so their
    # kernels take XLA's optimized code generation, not the suite's fast-compile flags (conftest).
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag not in FAST_COMPILE_FLAGS]
    monkeypatch.setenv("XLA_FLAGS", " ".join(kept))
    if path.name in NEED_SMOLLM2_DRAFTER and not DEFAULT_DRAFTER.exists() and not os.environ.get("DFLASH_JAX_DRAFTER"):
        pytest.skip(f"no SmolLM2 drafter: {DEFAULT_DRAFTER} is not in this checkout and DFLASH_JAX_DRAFTER is unset")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=2400, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    dirty = [
        i for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} hold outputs or execution counts; clear them with "
        f"`jupyter nbconvert --clear-output --inplace notebooks/{path.name}`"
    )


def test_there_are_notebooks():
    assert NOTEBOOKS
    assert NEED_SMOLLM2_DRAFTER <= {p.name for p in NOTEBOOKS}
