"""`dflash-jax serve` refuses bad flags, unusable models and a missing `serve` extra with one
line and exit code 2, before it binds the port (or, for a taken port, at the bind, before
compiling anything); stopped, it says so in one line."""

from __future__ import annotations

import json
import pathlib
import socket
import sys

import pytest

from conftest import drafter_config_dict, make_hf_target, make_zlab_drafter, save_hf
from dflash_jax import cli, staging
from dflash_jax.serve import cli as serve_cli
from test_serve import write_char_tokenizer


@pytest.fixture
def no_bind(monkeypatch):
    def fail(host, port):
        raise AssertionError("serve bound the port before refusing")

    monkeypatch.setattr(serve_cli, "bind", fail)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-cli") / "target"
    save_hf(make_hf_target("llama", num_hidden_layers=1), folder)
    return folder


def refused(capsys, argv) -> str:
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dflash-jax serve: error: ")
    return err


@pytest.mark.parametrize("argv, said", [
    (["--target", "/no/such/model"], "does not exist"),
    (["--port", "70000"], "--port"),
    (["--no-drafter", "--drafter", "/x"], "contradict"),
    (["--target", "/x", "--block-size", "4"], "needs --drafter"),
    (["--max-queue", "0"], "--max-queue"),
    (["--cycles-per-step", "0"], "--cycles-per-step"),
    (["--api-key", " "], "--api-key is empty"),
    (["--num-pages", "64", "--kv-cache-memory-fraction", "0.5"], "give one"),
    (["--kv-cache-memory-fraction", "1.5"], "(0, 1]"),
])
def test_bad_flags_exit_2_with_one_line(capsys, no_bind, argv, said):
    assert said in refused(capsys, argv)


@pytest.mark.parametrize("module", serve_cli.SERVE_EXTRA_MODULES)
def test_missing_serve_extra_is_named_before_anything_loads(capsys, monkeypatch, no_bind, module):
    monkeypatch.setitem(sys.modules, module, None)  # what find_spec reports for a module that is not installed
    monkeypatch.setattr(serve_cli, "load_engine", lambda args: pytest.fail("loaded the models first"))
    err = refused(capsys, ["--target", "/no/such/model", "--port", "70000"])
    assert f"needs {module} (not installed)" in err and "pip install 'dflash-jax[serve]'" in err


@pytest.mark.parametrize("stop, code, word", [(KeyboardInterrupt, 130, "interrupted"),
                                              (staging.Terminated, 143, "terminated")])
def test_a_stopped_server_claims_nothing_about_files(capsys, monkeypatch, stop, code, word):
    """uvicorn re-raises Ctrl-C or SIGTERM once it has shut down; the server writes no files, so
    its last line is not conversion's "nothing half-written was left behind"."""

    def stopped(args):
        raise stop

    monkeypatch.setattr(serve_cli, "run", stopped)
    assert cli.main(["serve"]) == code
    assert capsys.readouterr().err.strip().splitlines() == [f"dflash-jax serve: {word}."]


def test_unusable_checkpoint_exits_2(tmp_path, capsys, no_bind):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NotAModel"], "model_type": "nothing"}))
    write_char_tokenizer(tmp_path)
    assert "NotAModel" in refused(capsys, ["--target", str(tmp_path)])


def test_target_without_tokenizer_exits_2(tiny_target, capsys, no_bind):
    assert "tokenizer.json" in refused(capsys, ["--target", str(tiny_target)])


def test_bad_engine_size_exits_2(tiny_target, tmp_path, capsys, no_bind):
    write_char_tokenizer(tiny_target)
    assert "cannot hold 4 requests" in refused(capsys, ["--target", str(tiny_target), "--max-num-reqs", "4",
                                                       "--max-num-tokens", "3", "--no-drafter"])


def test_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv(serve_cli.API_KEY_VARIABLE, "sk-env")
    assert cli.parse_args(["serve", "--no-compile-cache"]).api_key == "sk-env"
    assert cli.parse_args(["serve", "--no-compile-cache", "--api-key", "sk-flag"]).api_key == "sk-flag"
    monkeypatch.setenv(serve_cli.API_KEY_VARIABLE, "")
    assert cli.parse_args(["serve", "--no-compile-cache"]).api_key is None


def test_kv_cache_sized_by_pages_or_by_free_memory(tiny_target):
    """--no-prefix-caching reaches the engine; --num-pages gives the cache that many pages; --kv-cache-memory-fraction a share of what
    the device (here the host) has free, so a larger share holds more pages."""
    write_char_tokenizer(tiny_target)
    parser = cli.build_parser()
    base = ["serve", "--target", str(tiny_target), "--no-drafter", "--max-model-len", "64"]
    engine, _, _ = serve_cli.load_engine(parser.parse_args(base + ["--num-pages", "40"]))
    assert engine.scheduler.allocator.num_pages == 40 and engine.prefix_caching
    uncached, _, _ = serve_cli.load_engine(parser.parse_args(base + ["--num-pages", "40", "--no-prefix-caching"]))
    assert not uncached.prefix_caching and uncached.prefix_cache_stats is None
    pages = [serve_cli.load_engine(parser.parse_args(base + ["--kv-cache-memory-fraction", share]))[0]
             .scheduler.allocator.num_pages for share in ("0.00001", "0.00002")]
    assert 2 <= pages[0] < pages[1]


def test_taken_port_exits_2_before_compiling(tiny_target, capsys, monkeypatch):
    write_char_tokenizer(tiny_target)
    monkeypatch.setattr("dflash_jax.Engine.precompile", lambda self: pytest.fail("compiled before binding"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "cannot bind" in refused(capsys, ["--target", str(tiny_target), "--port", str(port)])


def test_draft_sampling_reaches_the_engine(tmp_path, capsys, no_bind, monkeypatch):
    hf = make_hf_target("llama", num_hidden_layers=1)
    target = pathlib.Path(save_hf(hf, tmp_path / "target"))
    write_char_tokenizer(target)
    config = drafter_config_dict(hf.config.to_dict(), num_hidden_layers=1,
                                 dflash_config={"mask_token_id": 95, "block_size": 4})
    drafter = save_hf(make_zlab_drafter(config), tmp_path / "drafter", config)
    seen = {}

    def engine(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr("dflash_jax.Engine", engine)
    capsys.readouterr()  # the checkpoint writers' progress bars
    refused(capsys, ["--target", str(target), "--drafter", str(drafter), "--draft-sampling", "argmax"])
    assert seen["draft_sampling"] == "argmax"
