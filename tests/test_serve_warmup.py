"""A server that opens its port after one program: /health says warming (with the count)
while the rest compile in the background, a greedy request meanwhile is answered (on that
sampling program), and /health turns ready once every program is compiled."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import dflash_jax
from conftest import drafter_config_dict, make_zlab_drafter, save_hf
from dflash_jax.serve.cli import ModelInfo, bind, make_server
from dflash_jax.serve.warmup import split_programs
from dflash_jax.tokenizer import ChatTokenizer
from test_generate import biased_target
from test_serve import write_char_tokenizer


@pytest.mark.slow
def test_serves_while_warming_then_ready(tmp_path):
    hf = biased_target(seed=2)
    save_hf(hf, tmp_path / "target")
    write_char_tokenizer(tmp_path / "target")
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4})
    target = dflash_jax.load_target(tmp_path / "target")
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=3), tmp_path / "drafter", config))
    engine = dflash_jax.Engine(target, drafter, max_num_reqs=1, max_num_tokens=8)
    first, later = split_programs(engine, "minimal")
    assert first == engine.programs[:1] and first + later == engine.programs
    engine.precompile(programs=first)

    gate = threading.Event()

    def gated(programs):  # holds the background compilation until the test has seen "warming"
        assert gate.wait(120)
        yield from programs

    server = make_server(engine, ChatTokenizer(tmp_path / "target"), ModelInfo("tiny", 256, 4), max_queue=4,
                         shutdown_timeout_s=5, log_level="warning", warmup_programs=later, warmup_progress=gated,
                         compile_threads=2)
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert server.ready.wait(60), "the server did not start"
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["status"] == "warming"
        assert (health["programs_ready"], health["programs_total"]) == (len(first), len(engine.programs))
        answer = httpx.post(url + "/v1/completions", timeout=120,
                            json={"prompt": "Hello", "max_tokens": 6, "temperature": 0}).json()
        assert answer["usage"]["completion_tokens"] >= 1
        gate.set()
        for _ in range(240):
            health = httpx.get(url + "/health", timeout=10).json()
            if health["status"] == "ready":
                break
            time.sleep(0.5)
        assert health["status"] == "ready" and health["programs_ready"] == health["programs_total"]
    finally:
        gate.set()
        server.should_exit = True
        thread.join(60)
        sock.close()
    assert not thread.is_alive()
