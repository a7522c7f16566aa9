"""Bad input and faults through the `dflash-jax` CLI: one line saying what is wrong and what to
do, exit 2 (130 on Ctrl-C, 143 on SIGTERM), and no output folder lost, replaced unasked or
left half-written."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import make_hf_target, save_hf
from dflash_jax import cli, cli_convert, staging
from dflash_jax.formats import hf_to_nnx
from dflash_jax.formats.hf_to_nnx import convert_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# orbax's reads of a corrupt checkpoint end on their own threads after the error ("Event loop
# is closed"); the CLI drops that noise, pytest still notices it.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """hf/ (a tiny HF target) and orbax/ (it converted), shared read-only by the table."""
    tmp = tmp_path_factory.mktemp("models")
    save_hf(make_hf_target("qwen3", num_hidden_layers=2), tmp / "hf")
    convert_checkpoint(tmp / "hf", tmp / "orbax")
    return tmp


def copy_orbax(models, tmp_path, edit) -> Path:
    """A copy of the converted target with `edit(folder)` applied."""
    folder = tmp_path / "broken"
    shutil.copytree(models / "orbax", folder)
    edit(folder)
    return folder


def truncate_params(folder: Path) -> None:
    for path in (folder / "params").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[:50])


def set_meta(folder: Path, text: str) -> None:
    (folder / "dflash_jax.json").write_text(text)


def int64_tensor(models, tmp_path) -> Path:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf_int"
    shutil.copytree(models / "hf", folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int64)
    save_file(tensors, folder / "model.safetensors")
    return folder


def a_file(tmp_path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


GEN = ["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]
TRAIN = ["--num-layers", "1", "--block-size", "4", "--mask-token-id", "95"]

# id: (argv builder (models, tmp_path) -> argv, substring of the one-line message, exit code)
CASES = {
    "convert-onto-source": (lambda m, t: ["convert", m / "hf", m / "hf", "--force"], "is the source", 2),
    "convert-into-parent-of-source": (lambda m, t: ["convert", m / "hf", m, "--force"], "contains the source", 2),
    "convert-existing-out": (lambda m, t: ["convert", m / "hf", m / "orbax"], "already exists; pass --force", 2),
    "convert-unwritable-out": (lambda m, t: ["convert", m / "hf", a_file(t) / "out"], "Not a directory", 2),
    "convert-int64-tensor": (lambda m, t: ["convert", int64_tensor(m, t), t / "out"],
                             "tensor 'model.norm.weight' is stored as int64, not a floating-point type", 2),
    "convert-missing-source": (lambda m, t: ["convert", t / "nowhere", t / "out"], "does not exist", 2),
    "generate-corrupt-checkpoint": (lambda m, t: [*GEN, "--target", copy_orbax(m, t, truncate_params)],
                                    "could not be read or written", 2),
    "generate-no-format-file": (lambda m, t: [*GEN, "--target", copy_orbax(m, t, lambda f: (f / "dflash_jax.json").unlink())],
                                "without its dflash_jax.json", 2),
    "generate-bad-dtype": (lambda m, t: [*GEN, "--target", copy_orbax(m, t, lambda f: set_meta(
        f, '{"format": 2, "kind": "target", "dtype": "int7"}'))], "names dtype 'int7', not a float type", 2),
    "generate-bad-json": (lambda m, t: [*GEN, "--target", copy_orbax(m, t, lambda f: set_meta(f, "{"))],
                          "is not valid JSON", 2),
    "generate-temperature-inf": (lambda m, t: [*GEN, "--target", m / "orbax", "--temperature", "inf"],
                                 "temperature must be >= 0 and finite", 2),
    "generate-temperature-nan": (lambda m, t: [*GEN, "--target", m / "orbax", "--temperature", "nan"],
                                 "temperature must be >= 0 and finite", 2),
    "generate-top-p-nan": (lambda m, t: [*GEN, "--target", m / "orbax", "--top-p", "nan"], "top_p must lie in (0, 1]", 2),
    "generate-max-new-tokens-0": (lambda m, t: [*GEN, "--target", m / "orbax", "--max-new-tokens", "0"],
                                  "--max-new-tokens must be at least 1", 2),
    "generate-float-ids": (lambda m, t: [*GEN, "--target", m / "orbax", "--prompt-ids", "1.5,2"],
                           "comma-separated integers", 2),
    "train-lr-nan": (lambda m, t: ["train-drafter", m / "orbax", t / "d.npz", t / "run", *TRAIN, "--lr", "nan"],
                     "--lr must be a finite number > 0", 2),
    "train-steps-0": (lambda m, t: ["train-drafter", m / "orbax", t / "d.npz", t / "run", *TRAIN, "--steps", "0"],
                      "--steps must be at least 1", 2),
    "train-unwritable-out": (lambda m, t: ["train-drafter", m / "orbax", t / "d.npz", a_file(t) / "run", *TRAIN],
                             "Not a directory", 2),
    "train-missing-data": (lambda m, t: ["train-drafter", m / "orbax", t / "d.npz", t / "run", *TRAIN],
                           "does not exist; build it with", 2),
    "build-data-existing-out": (lambda m, t: ["build-drafter-data", m / "orbax", a_file(t), "--free", "2"],
                                "already exists; pass --force", 2),
    "build-data-unwritable-out": (lambda m, t: ["build-drafter-data", m / "orbax", a_file(t) / "d.npz", "--free", "2"],
                                  "Not a directory", 2),
    "build-data-temperature-nan": (lambda m, t: ["build-drafter-data", m / "orbax", t / "d.npz", "--free", "2",
                                                 "--temperatures", "0,nan"], "--temperatures must be a finite number", 2),
    "demo-block-size-0": (lambda m, t: ["demo", "--block-size", "0", "--cache-dir", t / "cache"],
                          "--block-size must be at least 2", 2),
}


UP_FRONT = {"convert-onto-source", "convert-into-parent-of-source", "convert-existing-out", "convert-unwritable-out",
            "train-lr-nan", "train-steps-0", "train-unwritable-out", "build-data-existing-out",
            "build-data-unwritable-out", "build-data-temperature-nan"}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_line(models, tmp_path, capsys, monkeypatch, case):
    build, message, code = CASES[case]
    argv = [str(a) for a in build(models, tmp_path)]
    if case in UP_FRONT:
        monkeypatch.setattr(hf_to_nnx, "model_from_hf", lambda *a, **k: pytest.fail("converted first"))
        import dflash_jax.loading

        monkeypatch.setattr(dflash_jax.loading, "load_target", lambda *a, **k: pytest.fail("loaded first"))
    before = sorted(p.name for p in models.iterdir())
    capsys.readouterr()
    assert cli.main(argv) == code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"dflash-jax {argv[0]}: error: ") and message in lines[0], lines[0]
    assert sorted(p.name for p in models.iterdir()) == before  # the source and the model folder are intact
    assert (models / "hf" / "model.safetensors").is_file() and (models / "orbax" / "dflash_jax.json").is_file()
    assert not [p for p in tmp_path.iterdir() if ".staging." in p.name]


def test_build_data_keeps_an_existing_file(models, tmp_path):
    out = a_file(tmp_path)
    assert cli.main(["build-drafter-data", str(models / "orbax"), str(out), "--free", "2"]) == 2
    assert out.read_text() == "not a folder"


def test_a_folder_that_appears_during_conversion_is_kept(models, tmp_path, monkeypatch, capsys):
    """Another run (or a user) creates OUT while this conversion runs: it is left alone, and
    this conversion fails clearly instead of replacing it."""
    out = tmp_path / "out"
    real = hf_to_nnx.save_checkpoint

    def meanwhile(*args, **kwargs):
        real(*args, **kwargs)
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(hf_to_nnx, "save_checkpoint", meanwhile)
    capsys.readouterr()
    assert cli.main(["convert", str(models / "hf"), str(out)]) == 2
    assert "appeared while this conversion was being written" in capsys.readouterr().err
    assert os.listdir(out) == ["theirs.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_empty_folder_that_appears_is_not_replaced_either(models, tmp_path, monkeypatch):
    """os.rename would silently replace an empty folder; the rename into place must not."""
    out = tmp_path / "out"
    real = hf_to_nnx.save_checkpoint
    monkeypatch.setattr(hf_to_nnx, "save_checkpoint", lambda *a, **k: (real(*a, **k), out.mkdir()))
    assert cli.main(["convert", str(models / "hf"), str(out)]) == 2
    assert out.is_dir() and os.listdir(out) == []


def test_forced_replacement_swaps_and_restores_on_failure(models, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(models / "orbax", out)
    (out / "old.txt").write_text("old")

    real_rename = staging.rename_noreplace

    def fail(src, dst):  # moving the new output in fails; putting the old one back works
        if Path(src).name == "new":
            raise OSError(28, "No space left on device", str(dst))
        real_rename(src, dst)

    monkeypatch.setattr(staging, "rename_noreplace", fail)
    assert cli.main(["convert", str(models / "hf"), str(out), "--force"]) == 2
    assert (out / "old.txt").read_text() == "old"  # the old output is back in place, whole
    monkeypatch.undo()
    assert cli.main(["convert", str(models / "hf"), str(out), "--force"]) == 0
    assert not (out / "old.txt").exists() and (out / "dflash_jax.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_staging_of_a_dead_process_is_removed(models, tmp_path):
    host = staging._HOST
    stale = tmp_path / f".out.staging.{host}.{dead_pid()}.abc"
    (stale / "new").mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".out.staging.{host}.{sleeper.pid}.abc"
        live.mkdir()
        assert cli.main(["convert", str(models / "hf"), str(tmp_path / "out")]) == 0
        assert not stale.exists() and live.exists()  # a running conversion's folder is left alone
    finally:
        sleeper.kill()
        sleeper.wait()


def test_unexpected_failure_is_one_line_marked_as_a_bug(monkeypatch, capsys, tmp_path):
    def bug(args):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(cli_convert, "run", bug)
    assert cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this is a bug" in err[0] and "--debug" in err[0]
    with pytest.raises(TypeError):
        cli.main(["--debug", "convert", str(tmp_path / "a"), str(tmp_path / "b")])


def test_keyboard_interrupt_in_process_exits_130(monkeypatch, capsys, tmp_path):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_convert, "run", interrupted)
    assert cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "b")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["dflash-jax convert: interrupted; nothing half-written was left behind."]


# A conversion that stops after writing its checkpoint into the staging folder, so a signal
# arrives while the staging folder is full.
SLOW_CONVERT = """
import pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal: a background job inherits it ignored
import dflash_jax.formats.hf_to_nnx as h
real = h.save_checkpoint
def slow(*args, **kwargs):
    real(*args, **kwargs)
    pathlib.Path(sys.argv[2] + ".ready").write_text("")
    time.sleep(120)
h.save_checkpoint = slow
from dflash_jax.cli import main
sys.exit(main(["convert", sys.argv[1], sys.argv[2]]))
"""


@pytest.mark.parametrize("signum, code, word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_signal_during_conversion_leaves_no_staging(models, tmp_path, signum, code, word):
    out = tmp_path / "work" / "out"
    out.parent.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    child = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, str(models / "hf"), str(out)],
                             stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    ready = Path(f"{out}.ready")
    deadline = time.monotonic() + 600  # far above the quiet time: a loaded machine imports jax slowly
    while not ready.exists():
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read() if child.poll() else "timeout"
        time.sleep(0.1)
    assert [p for p in out.parent.iterdir() if ".staging." in p.name]  # the staging folder is there now
    child.send_signal(signum)
    _, err = child.communicate(timeout=300)
    assert child.returncode == code, err
    lines = [line for line in err.splitlines() if line.strip() and "converting" not in line]
    assert lines == [f"dflash-jax convert: {word}; nothing half-written was left behind."], err
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.ready"]
