"""The package's shape: imports that run one way, kernels that know nothing of the library,
no environment reads in library code, one caller of the samplers, one legend of shape letters.
Read from the source (every import statement, lazy ones inside functions included), so nothing
needs importing."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_jax", "pallas_kernels", "convert")
# The import direction, top to bottom: a package may import only the packages below it.
LAYERS = ("bench", "convert", "dflash_jax", "pallas_kernels")


def modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = ast.parse(path.read_text(), str(path))
    return found


def imported_names(tree: ast.Module) -> set[str]:
    """Every dotted name a module's absolute imports name, anywhere in its file
    (`from package import name` gives both `package` and `package.name`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.update([f"{node.module}.{alias.name}" for alias in node.names] + [node.module])
    return out


def imports_of(name: str, tree: ast.Module, known) -> set[str]:
    """The project modules `name` imports, anywhere in its file (`from package import module`
    counts as the module when it is one)."""
    out = set()
    for target in imported_names(tree):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph():
    trees = modules()
    return {name: imports_of(name, tree, trees) for name, tree in trees.items()}


def test_no_import_cycles():
    graph = import_graph()
    # A package's __init__ re-exporting its modules is not a cycle of the modules it names.
    edges = {m: {t for t in ts if not (m in PACKAGES or t in PACKAGES or t.startswith(m + "."))}
             for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(module, path):
        state[module] = 1
        for nxt in sorted(edges[module]):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [module, nxt])}"
            if nxt not in state:
                visit(nxt, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])


def test_kernels_import_no_library_code():
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("pallas_kernels"):
            outside = {t for t in targets if not t.startswith("pallas_kernels")}
            assert not outside, f"{module} imports {sorted(outside)}: kernels may import only jax, numpy and each other"


def test_checkpoint_is_orbax_only():
    assert not any(t.startswith(("convert", "dflash_jax.formats")) for t in import_graph()["dflash_jax.checkpoint"])


def test_library_never_imports_convert():
    """What the library reads and writes of HF folders and GGUF files lives in it
    (`dflash_jax.formats`, `dflash_jax.staging`); `convert` builds on the library, never under it."""
    for module, targets in import_graph().items():
        if module.startswith("dflash_jax"):
            upward = sorted(t for t in targets if t.partition(".")[0] == "convert")
            assert not upward, f"{module} imports {upward}: move what it needs into the library"


def test_imports_run_one_way():
    """bench -> convert -> dflash_jax -> pallas_kernels: no package imports one above it
    (bench is not parsed: it sits at the top, so nothing it imports can point upward)."""
    for name, tree in modules().items():
        above = LAYERS[: LAYERS.index(name.partition(".")[0])]
        upward = sorted(t for t in imported_names(tree) if t.partition(".")[0] in above)
        assert not upward, f"{name} imports {upward}: imports run {' -> '.join(LAYERS)}"


def test_library_reads_no_environment():
    """Only the command line's entry point may take defaults from the environment."""
    for name, tree in modules().items():
        if name == "dflash_jax.cli":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                raise AssertionError(f"{name} reads the environment (line {node.lineno}); take a parameter instead")


def test_one_caller_of_the_samplers():
    callers = set()
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("rejection_sample", "sample_drafts"):
                callers.add(name)
            if isinstance(node, ast.ImportFrom) and any(a.name in ("rejection_sample", "sample_drafts")
                                                        for a in node.names):
                callers.add(name)
    assert callers == {"dflash_jax.cycle"}, callers


def test_modules_stay_small():
    for package in ("dflash_jax",):
        for path in (ROOT / package).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            assert lines <= 520, f"{path.relative_to(ROOT)} has {lines} lines; split it by concern"


@pytest.mark.parametrize("module", ["convert", "dflash_jax.formats.hf_to_nnx", "dflash_jax.formats.weight_map",
                                    "dflash_jax", "dflash_jax.config", "dflash_jax.cli", "pallas_kernels"])
def test_each_package_imports_first(module):
    """Imported first in a fresh interpreter, no package runs another's modules half-built
    (the module graph can be acyclic while package __init__ files still chain into a loop)."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


# A shape suffix: the last `_`-separated part of a name that starts in lowercase, made of
# uppercase letters and digits, with single lowercase letters for local axes (`q_tNH`).
_SHAPE_NAME = re.compile(
    r"(?<![A-Za-z0-9_])_*[a-z][a-z0-9_]*_((?:[A-Z0-9]|[a-z](?![a-z]))*[A-Z](?:[A-Z0-9]|[a-z](?![a-z]))*)(?![A-Za-z0-9_])"
)


def shape_legend() -> list[str]:
    """The letters of docs/ARCHITECTURE.md's "Shape letters" table, in its order."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Shape letters\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| ([A-Z]) \|", section, flags=re.M)


def shape_names():
    """(path, line, name, suffix) of every shape-suffixed name in the library and the kernels,
    code, docstrings and comments alike."""
    for package in ("dflash_jax", "pallas_kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in _SHAPE_NAME.finditer(line):
                    yield path.relative_to(ROOT), number, match.group(0), match.group(1)


def test_shape_legend_has_one_row_per_letter():
    letters = shape_legend()
    assert len(letters) >= 10, "docs/ARCHITECTURE.md lost its \"Shape letters\" table"
    assert len(letters) == len(set(letters)), f"letters listed twice: {sorted({c for c in letters if letters.count(c) > 1})}"


def test_shape_suffixes_use_the_legend():
    """Every suffix letter of `dflash_jax/` and `pallas_kernels/` means what the legend says:
    a new axis gets a row there (one meaning per letter) or a lowercase letter its function defines."""
    legend = set(shape_legend())
    strays = [f"{path}:{number} {name}" for path, number, name, suffix in shape_names()
              if set(re.sub(r"[^A-Z]", "", suffix)) - legend]
    assert not strays, "shape letters not in docs/ARCHITECTURE.md's legend:\n" + "\n".join(strays)


def test_every_legend_letter_is_used():
    used = {c for *_, suffix in shape_names() for c in suffix if c.isupper()}
    unused = sorted(set(shape_legend()) - used)
    assert not unused, f"legend rows no name uses (drop them): {unused}"
