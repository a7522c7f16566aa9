"""bench/ is one package: every module imports and every command parses its flags, no code file
outgrows 600 lines, nothing edits sys.path, and no benchmark reaches into the library's
private names (a benchmark that needs one asks the library for a public door)."""

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import bench

BENCH = Path(bench.__file__).parent
TESTS = Path(__file__).parent
LIBRARY = ("dflash_jax", "pallas_kernels", "convert")
MODULES = sorted(m.name for m in pkgutil.walk_packages(bench.__path__, "bench."))


def code_files() -> list[Path]:
    """bench's Python modules and shell plans (its results and notes are data, not code)."""
    return sorted(p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.parts)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_and_its_command_parses(name, capsys):
    module = importlib.import_module(name)
    main = getattr(module, "main", None)
    if main is None or not inspect.signature(main).parameters:
        return
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_no_code_file_over_600_lines():
    lengths = {str(p.relative_to(BENCH)): len(p.read_text().splitlines()) for p in code_files()}
    assert lengths and not {p: n for p, n in lengths.items() if n > 600}


def uses_sys_path(source: str) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
               and node.value.id == "sys" for node in ast.walk(ast.parse(source)))


def test_nothing_edits_sys_path():
    """Neither bench nor the tests that import it: the repository root is on the path (python
    -m from the root; pytest's `pythonpath` setting)."""
    users = [p for p in sorted(TESTS.glob("test_*.py")) if re.search(r"^(from|import) bench\b", p.read_text(), re.M)]
    offenders = [str(p) for p in [*code_files(), *users] if p.suffix == ".py" and uses_sys_path(p.read_text())]
    assert users and not offenders


def is_library(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in LIBRARY


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def root_of(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def library_names(tree: ast.Module) -> set[str]:
    """Names bound to the library's modules and objects: imported from it, or assigned what a
    call of such a name returns (`engine = Engine(...)`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names if is_library(alias.name)}
        elif isinstance(node, ast.ImportFrom) and not node.level and is_library(node.module):
            names |= {alias.asname or alias.name for alias in node.names}
    assigned = [node for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)]
    while True:
        more = {target.id for node in assigned if isinstance(root := root_of(node.value), ast.Name) and root.id in names
                for target in node.targets if isinstance(target, ast.Name)} - names
        if not more:
            return names
        names |= more


def reach_ins(source: str) -> list[str]:
    """Where `source` uses a private name of the library or assigns to one of its attributes."""
    tree = ast.parse(source)
    names = library_names(tree)

    def from_library(node: ast.AST) -> bool:
        root = root_of(node)
        return isinstance(root, ast.Name) and root.id in names

    def imported_module(node: ast.AST) -> bool:
        """importlib.import_module("dflash_jax...") or __import__("dflash_jax...")."""
        return (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and is_library(node.args[0].value))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and is_library(node.module):
            found += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names if is_private(a.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and (
                from_library(node.value) or imported_module(node.value)):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and is_private(str(node.args[1].value))
              and from_library(node.args[0])):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"line {node.lineno}: assigns .{t.attr}" for t in targets
                      if isinstance(t, ast.Attribute) and from_library(t.value)]
    return found


@pytest.mark.parametrize("snippet", [
    'import importlib\nprogram = importlib.import_module("dflash_jax.generate")._program',
    "from dflash_jax.sampling import _truncation_mask",
    "from dflash_jax import sampling\nsampling._threshold_truncation_mask(x)",
    "from dflash_jax import sampling\nsampling.threshold_digit_bits = lambda rows: 8",
    "from dflash_jax.engine import Engine\nengine = Engine(t)\nengine._launch = timed",
    "import dflash_jax.engine\nvalue = dflash_jax.engine._HashedOnce",
    "from dflash_jax import engine\nkey = getattr(engine, '_HashedOnce')",
])
def test_the_scan_finds_reach_ins(snippet):
    assert reach_ins(snippet)


def test_no_private_library_names_in_bench():
    found = {str(p.relative_to(BENCH)): reach_ins(p.read_text()) for p in code_files() if p.suffix == ".py"}
    assert not {path: lines for path, lines in found.items() if lines}
