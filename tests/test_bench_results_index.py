"""bench/results/INDEX.md is generated from the result files (`python -m bench.results_index`):
it must be up to date, and the generator must read dates, devices, titles, benchmarks and
commits from the files themselves."""

import importlib.util
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_index", REPO / "bench" / "results_index.py")
results_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_index)


def test_index_in_the_repo_is_up_to_date():
    run = subprocess.run([sys.executable, "-m", "bench.results_index", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr + "\nrun `python -m bench.results_index` and commit bench/results/INDEX.md"


def rows(index_text):
    """{group: [[date, file, device, title, benchmark, commit], ...]} from INDEX.md's tables."""
    groups, group = {}, None
    for line in index_text.splitlines():
        if line.startswith("## "):
            group = line[3:].rsplit(" (", 1)[0]
            groups[group] = []
        elif line.startswith("| 20"):
            groups[group].append([cell.strip() for cell in line.strip("|").split(" | ")])
    return groups


def fake_results(folder):
    (folder / "raw").mkdir(parents=True)
    (folder / "2026-11-29-qwen3-8b-shape-h200.md").write_text(
        "# Decode speed at Qwen3-8B shape\n\nDevice: one NVIDIA H200.\n")
    (folder / "raw" / "2026-12-01-qwen3-8b-shape-b1.json").write_text(json.dumps({
        "date": "2026-12-01 11:49 UTC", "commit": "8b22852",
        "versions": {"device": "NVIDIA H200", "num_devices": 1},
        "command": "python bench/bench_decode.py --commit 8b22852 --out /root/out/b1.json --points 1x1k",
        "env": {"XLA_FLAGS": ""}, "points": [],
    }))
    (folder / "raw" / "2026-11-30-oracle-held-out.json").write_text(json.dumps({
        "device": "cpu", "jax": "0.10.2", "prompts": "held-out", "num_prompts": 32, "results": {},
    }))


def test_generator_rows_from_fake_result_files(tmp_path):
    fake_results(tmp_path)
    assert results_index.main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "INDEX.md").read_text()
    assert text.splitlines()[0].startswith("# ") and "do not edit by hand" in text.splitlines()[0]
    assert rows(text) == {
        "Acceptance: sampling, argmax drafts, the ceiling": [
            ["2026-11-30", "[raw/2026-11-30-oracle-held-out.json](raw/2026-11-30-oracle-held-out.json)", "CPU",
             "prompts=held-out, num_prompts=32", "", ""],
        ],
        "Decode step at model shapes": [  # newest first
            ["2026-12-01", "[raw/2026-12-01-qwen3-8b-shape-b1.json](raw/2026-12-01-qwen3-8b-shape-b1.json)", "H200",
             "bench/bench_decode.py --points 1x1k", "bench_decode", "8b22852"],
            ["2026-11-29", "[2026-11-29-qwen3-8b-shape-h200.md](2026-11-29-qwen3-8b-shape-h200.md)", "H200",
             "Decode speed at Qwen3-8B shape", "", ""],
        ],
    }
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 0


def test_check_fails_when_a_result_file_is_added(tmp_path, capsys):
    fake_results(tmp_path)
    results_index.main(["--results", str(tmp_path)])
    (tmp_path / "2026-12-02-serve-cpu.md").write_text("# Serving on the CPU\n")
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    results_index.main(["--results", str(tmp_path)])
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 0
    assert ["2026-12-02", "[2026-12-02-serve-cpu.md](2026-12-02-serve-cpu.md)", "CPU", "Serving on the CPU", "", ""] \
        in rows((tmp_path / "INDEX.md").read_text())["Serving"]
