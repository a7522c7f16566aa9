"""`serve --api-key`: the /v1 routes answer 401 in OpenAI's shape without the server's Bearer
token (the official client raises AuthenticationError), answer with it, and /health and
/metrics stay open; the 401s are counted like every other answer."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

import dflash_jax
from conftest import save_hf
from dflash_jax.serve.cli import ModelInfo, bind, make_server
from dflash_jax.tokenizer import ChatTokenizer
from test_generate import biased_target
from test_serve import write_char_tokenizer

KEY = "sk-test-0123"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("auth") / "target"
    save_hf(biased_target(seed=2), target_dir)
    write_char_tokenizer(target_dir)
    engine = dflash_jax.Engine(dflash_jax.load_target(target_dir), None, max_num_reqs=1, max_num_tokens=16)
    server = make_server(engine, ChatTokenizer(target_dir), ModelInfo("tiny", 256, 1), max_queue=4,
                         shutdown_timeout_s=60, log_level="warning", api_key=KEY)
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert server.ready.wait(60), "the server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(60)
    sock.close()


@pytest.mark.parametrize("key", [None, "sk-wrong", KEY + "x"])
def test_a_missing_or_wrong_key_gets_401(url, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    for method, route in (("GET", "/v1/models"), ("POST", "/v1/completions")):
        response = httpx.request(method, url + route, headers=headers, json={"prompt": "Hi", "max_tokens": 2},
                                 timeout=60)
        assert response.status_code == 401, (route, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"


def test_the_key_opens_the_routes_and_health_and_metrics_need_none(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=300) as client:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300) as client:
        answer = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens >= 1
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    metrics = httpx.get(url + "/metrics", timeout=60)
    assert metrics.status_code == 200 and 'status="401"' in metrics.text
