"""The HTTP server on a tiny random DFlash pair, driven by the official openai client: greedy
answers equal `generate` token for token, streams equal whole answers, concurrent requests
equal their solo results, bad requests get OpenAI's error shape, disconnects abort, /metrics
parses and moves, a failing step fails only its requests, z-lab's `dflash generate openai`
runs unchanged, and a stop request drains the requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dflash_jax
from conftest import drafter_config_dict, make_zlab_drafter, save_hf
from dflash_jax.serve.cli import ModelInfo, bind, make_server
from dflash_jax.tokenizer import ChatTokenizer
from test_generate import biased_target

MODEL = "tiny"
MAX_MODEL_LEN = 256
EOS = 0
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["Hello there", "The quick brown fox", "1, 2, 3, 4,", "Once upon a time, in a land far away,", "x"]
CONCURRENT = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(16)]
CHATS = {
    "colour": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    "two": [{"role": "user", "content": "What is two plus two?"}],
}
ALL_TEXT_PROMPTS = PROMPTS + CONCURRENT
ALL_CHATS = list(CHATS.values())
REFERENCE_TOKENS = 60


def write_char_tokenizer(folder) -> None:
    """A character tokenizer for the tiny models' 96 ids: <|end|> (the EOS) at 0, printable
    ASCII from ' ' to '}' at 1..94, <mask> (the drafter's mask token) at 95."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<|end|>": EOS, **{chr(c): c - 31 for c in range(32, 126)}, "<mask>": 95}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<|end|>", "<mask>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, tokenizer, target, drafter) with the server running in a thread on a free port."""
    tmp = tmp_path_factory.mktemp("serve")
    hf = biased_target(seed=2)
    target_dir = tmp / "target"
    save_hf(hf, target_dir)
    write_char_tokenizer(target_dir)
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4})
    target = dflash_jax.load_target(target_dir)
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=3), tmp / "drafter", config))
    tokenizer = ChatTokenizer(target_dir)
    # Programs compile as the tests need them (a CPU CI budget); `serve` itself precompiles.
    engine = dflash_jax.Engine(target, drafter, max_num_reqs=4, max_num_tokens=16)
    server = make_server(engine, tokenizer, ModelInfo(MODEL, MAX_MODEL_LEN, 4), max_queue=32, shutdown_timeout_s=120,
                         log_level="warning")
    sock = bind("127.0.0.1", 0)
    server.port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert server.ready.wait(60), "the server did not start"
    yield server, tokenizer, target, drafter
    server.should_exit = True
    thread.join(60)
    sock.close()
    assert not thread.is_alive()


def base_url(server) -> str:
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=base_url(served[0]) + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


_references: dict[tuple[int, ...], list[int]] = {}


def reference(served, prompts_ids, max_new_tokens) -> list[list[int]]:
    """Offline greedy DFlash tokens (block size 4, float32), up to and with the EOS.

    One `generate` call of REFERENCE_TOKENS answers every prompt the module asks about (one
    compilation); a shorter answer is its prefix, greedy decoding being the same either way."""
    tokenizer, target, drafter = served[1], served[2], served[3]
    if not _references:
        every = [tokenizer.encode_text(p) for p in ALL_TEXT_PROMPTS] + [tokenizer.encode(m) for m in ALL_CHATS]
        out = dflash_jax.generate(target, drafter, every, max_new_tokens=REFERENCE_TOKENS, block_size=4,
                                  stop_token_ids=[EOS]).token_ids
        _references.update({tuple(ids): answer for ids, answer in zip(every, out)})
    assert max_new_tokens <= REFERENCE_TOKENS
    answers = []
    for ids in prompts_ids:
        answer = _references[tuple(ids)][:max_new_tokens]
        answers.append(answer[: answer.index(EOS) + 1] if EOS in answer else answer)
    return answers


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(ids)


def metric_values(server) -> dict:
    """{(name, sorted labels): value} of the server's /metrics."""
    body = httpx.get(base_url(server) + "/metrics", timeout=300).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def test_models_and_health(served):
    server = served[0]
    models = httpx.get(base_url(server) + "/v1/models", timeout=300).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key="none", max_retries=0) as client:
        assert client.models.retrieve(MODEL).id == MODEL  # OpenAI's GET /v1/models/{id}
        with pytest.raises(openai.NotFoundError, match="does not exist here"):
            client.models.retrieve("gpt-4")
    health = httpx.get(base_url(server) + "/health", timeout=300)
    assert health.status_code == 200 and health.json()["status"] == "ready"


@pytest.mark.slow
def test_greedy_completions_equal_generate(served, client):
    tokenizer = served[1]
    prompts_ids = [tokenizer.encode_text(p) for p in PROMPTS[:3]]
    expected = reference(served, prompts_ids, 24)
    for prompt, ids, want in zip(PROMPTS, prompts_ids, expected):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == text_of(tokenizer, want)
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want)
        assert out.choices[0].finish_reason == ("stop" if want[-1] == EOS else "length")
    by_ids = client.completions.create(model=MODEL, prompt=prompts_ids[0], max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == text_of(tokenizer, expected[0])


def test_greedy_chat_equals_generate(served, client):
    tokenizer = served[1]
    messages = CHATS["colour"]
    want = reference(served, [tokenizer.encode(messages)], 30)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert out.choices[0].message.content == text_of(tokenizer, want)
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == len(want)
    assert out.usage.total_tokens == out.usage.prompt_tokens + len(want)


def test_streams_concatenate_to_whole_answers(served, client):
    messages = [{"role": "user", "content": "Count to five."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # it did stream
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40,
                                                                   temperature=0, stream=True)]
    assert "".join(pieces) == whole.choices[0].text


@pytest.mark.slow
def test_sixteen_concurrent_requests_equal_their_solo_results(served):
    tokenizer = served[1]
    prompts = CONCURRENT
    lengths = [8 + 3 * i for i in range(16)]
    expected = [text_of(tokenizer, reference(served, [tokenizer.encode_text(p)], n)[0])
                for p, n in zip(prompts, lengths)]

    async def one(client, prompt, n, stream):
        if not stream:
            out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
            return out.choices[0].text
        return "".join([c.choices[0].text async for c in await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True)])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=base_url(served[0]) + "/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, p, n, i % 2 == 1)
                                          for i, (p, n) in enumerate(zip(prompts, lengths))))

    assert asyncio.run(all_at_once()) == expected


def test_stop_strings_and_stop_token_ids(served, client):
    tokenizer = served[1]
    ids = tokenizer.encode_text(PROMPTS[1])
    want = reference(served, [ids], 40)[0]
    full = text_of(tokenizer, want)
    stop = full[6:8]
    expected = full[: full.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    # One character a token: the answer's tokens run to the one completing the stop string, not past it.
    assert out.usage.completion_tokens == full.index(stop) + len(stop)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == expected
    stop_id = want[5]
    by_id = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id]})
    cut = want.index(stop_id)
    assert by_id.choices[0].text == text_of(tokenizer, want[:cut])
    assert by_id.usage.completion_tokens == cut + 1 and by_id.choices[0].finish_reason == "stop"


def test_ignore_eos_runs_past_the_end_tokens(served, client, monkeypatch):
    """With the tokenizer's end token set to one the answer holds, the answer stops there;
    `ignore_eos` runs on to max_tokens (a request's own stop_token_ids still stop it)."""
    tokenizer = served[1]
    want = reference(served, [tokenizer.encode_text(PROMPTS[1])], 30)[0]
    monkeypatch.setattr(tokenizer, "stop_token_ids", [want[4]])
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0)
    ended = client.completions.create(**kwargs)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == want.index(want[4]) + 1
    ignoring = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert ignoring.choices[0].text == text_of(tokenizer, want) and ignoring.choices[0].finish_reason == "length"
    assert ignoring.usage.completion_tokens == 30
    stopped = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "stop_token_ids": [want[7]]})
    assert stopped.usage.completion_tokens == want.index(want[7]) + 1


def test_seeded_sampling_repeats(served, client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    assert client.completions.create(**kwargs, extra_body={"top_k": 5}).usage.completion_tokens > 0


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "a" * MAX_MODEL_LEN}, "prompt"),
    ("/v1/completions", {"prompt": "a" * 200, "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 999]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": [5, True]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),  # no coercion of strings or bools
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 3, "seed": 2147483646}, "n"),  # choice 2 would sample with seed 2**31
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 200}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/cat.png"}}, {"type": "text", "text": "a"}]}]},
     "messages.0.content"),
]


@pytest.mark.parametrize("route, body, param", BAD_REQUESTS)
def test_bad_requests_get_400_in_openai_shape(served, route, body, param):
    response = httpx.post(base_url(served[0]) + route, json={"model": MODEL, **body}, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_unknown_model_is_404_model_not_found(served, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="a")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


@pytest.mark.parametrize("body, said", [
    (b'{"prompt": "a", "temperature": NaN}', "finite"),
    (b'{"prompt": "a\\ud800b"}', "not valid JSON"),  # a lone UTF-16 surrogate
    (b'{"prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "not valid JSON"),  # nesting past the parser's limit
    (b"[1, 2]", "JSON object"),
])
def test_malformed_bodies_are_400_and_counted(served, body, said):
    before = metric_values(served[0])
    response = httpx.post(base_url(served[0]) + "/v1/completions", content=body, timeout=300)
    assert response.status_code == 400 and said in response.json()["error"]["message"], response.text
    after = metric_values(served[0])
    key = ("dflash_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))
    assert after[key] == before.get(key, 0) + 1


def test_oversized_body_is_413_and_others_are_served(served, client):
    """Past the limit the body is refused as it arrives (no Content-Length to trust either)."""
    app_limit = 4 << 20
    huge = b'{"prompt": "' + b"a" * (app_limit + 1) + b'"}'
    for declared in (True, False):
        content = huge if declared else iter([huge[i : i + 65536] for i in range(0, len(huge), 65536)])
        response = httpx.post(base_url(served[0]) + "/v1/completions", content=content, timeout=300)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0).choices[0].text


def test_uncaught_errors_are_500_and_counted(served, monkeypatch):
    server = served[0]
    monkeypatch.setattr(server.engine_loop, "submit", _raise_bug)
    before = metric_values(server)
    with httpx.Client(base_url=base_url(server), timeout=300) as connection:
        response = connection.post("/v1/completions", json={"prompt": "a"})
        assert response.status_code == 500 and "injected bug" in response.json()["error"]["message"]
        assert connection.get("/v1/models").status_code == 200  # the connection stays open after a 500
    key = ("dflash_requests_total", (("endpoint", "/v1/completions"), ("status", "500")))
    assert metric_values(server)[key] == before.get(key, 0) + 1


async def _raise_bug(*args):
    raise RuntimeError("injected bug")


def test_wrong_routes_and_bodies(served, client):
    url = base_url(served[0])
    assert httpx.get(url + "/v1/nothing", timeout=300).status_code == 404
    wrong_method = httpx.get(url + "/v1/completions", timeout=300)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]
    not_json = httpx.post(url + "/v1/completions", content=b"{not json", timeout=300)
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="less than or equal to 16"):
        client.completions.create(model=MODEL, prompt="a", n=17)


def test_full_queue_answers_429(served, client):
    loop = served[0].engine_loop
    limit, loop.max_open = loop.max_open, 0
    try:
        response = httpx.post(base_url(served[0]) + "/v1/completions", json={"prompt": "a"}, timeout=300)
    finally:
        loop.max_open = limit
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    assert response.json()["error"]["type"] == "rate_limit_error"


@contextlib.contextmanager
def held_engine(loop):
    """(gate, aborted): the loop's engine steps only while `gate` is set (it starts set), and
    `aborted` is set once anything asks the loop to abort a request."""
    engine, real_step, real_abort = loop.engine, loop.engine.step, loop.abort
    gate, aborted = threading.Event(), threading.Event()
    gate.set()

    def gated_step():
        assert gate.wait(60)
        return real_step()

    def watched_abort(handle, reason="abort"):
        aborted.set()
        real_abort(handle, reason)

    engine.step, loop.abort = gated_step, watched_abort
    try:
        yield gate, aborted
    finally:
        gate.set()
        del engine.step, loop.abort


def test_disconnect_mid_stream_aborts_the_request(served):
    """The engine is held between steps while the client leaves, so the request cannot run to
    its end first; then it must be aborted, not finished."""
    server = served[0]
    loop = server.engine_loop
    before = metric_values(server)
    with held_engine(loop) as (gate, aborted):
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(timeout=300) as http:
            with http.stream("POST", base_url(server) + "/v1/completions", json=body) as response:
                next(response.iter_lines())
                gate.clear()
        assert aborted.wait(30), "the server did not notice the disconnect"
        gate.set()
        assert loop.idle.wait(30)
    after = metric_values(server)
    finished = lambda m, reason: m.get(("dflash_requests_finished_total", (("reason", reason),)), 0)
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert finished(after, "length") == finished(before, "length")
    assert not loop.engine.has_unfinished()


def test_plain_answer_client_gone_aborts_without_tracebacks(served, caplog):
    """A non-streaming client that leaves while its answer is generated: the request is
    aborted and nothing is logged as an error (by the app or by uvicorn)."""
    server = served[0]
    loop = server.engine_loop
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(caplog.handler)
    try:
        with held_engine(loop) as (gate, aborted):
            gate.clear()
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base_url(server) + "/v1/completions", json={"prompt": "abc", "max_tokens": 200},
                           timeout=httpx.Timeout(300, read=2))
            assert aborted.wait(30), "the server did not notice the client leave"
            gate.set()
            assert loop.idle.wait(30)
            time.sleep(0.5)  # anything logged about the answer nobody reads is logged by now
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_failing_step_fails_its_requests_and_serving_goes_on(served, client):
    loop = served[0].engine_loop
    engine, real_step = loop.engine, loop.engine.step
    failures = [RuntimeError("injected device failure")]

    def failing_step():
        if failures:
            raise failures.pop()
        return real_step()

    engine.step = failing_step
    try:
        response = httpx.post(base_url(served[0]) + "/v1/completions",
                              json={"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0}, timeout=300)
    finally:
        del engine.step
    assert response.status_code == 500 and "injected device failure" in response.json()["error"]["message"]
    assert loop.step_failures >= 1
    tokenizer = served[1]
    want = reference(served, [tokenizer.encode_text(PROMPTS[0])], 10)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert out.choices[0].text == text_of(tokenizer, want)


def test_metrics_parse_and_move(served, client):
    server = served[0]
    before = metric_values(server)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                         temperature=0)
    after = metric_values(server)
    moved = lambda name, labels=(): after.get((name, labels), 0) - before.get((name, labels), 0)
    assert moved("dflash_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200"))) == 1
    assert moved("dflash_completion_tokens_total") == out.usage.completion_tokens
    assert moved("dflash_prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("dflash_accepted_length_count") >= 1
    assert moved("dflash_time_to_first_token_seconds_count") == 1
    assert moved("dflash_engine_step_seconds_count") >= 1
    assert ("dflash_queue_depth", ()) in after and ("dflash_preemptions_total", ()) in after
    # vLLM's speculative-decoding counters: one count per cycle that checked drafts (block 4: 3
    # drafts at most), its accepted drafts (tokens committed less one), by block position.
    drafts = moved("dflash_spec_decode_num_drafts_total")
    accepted = moved("dflash_spec_decode_num_accepted_tokens_total")
    assert 1 <= drafts <= moved("dflash_accepted_length_count")
    assert drafts <= moved("dflash_spec_decode_num_draft_tokens_total") <= 3 * drafts
    assert accepted == moved("dflash_accepted_length_sum") - moved("dflash_accepted_length_count")
    per_position = [moved("dflash_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))
                    for p in range(3)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert 0 <= after[("dflash_kv_cache_usage_perc", ())] <= 1


def test_logprobs_are_the_targets_own(served, client):
    """Chat logprobs (whole and streamed) and the completions shape: each returned token's
    log-probability and its top alternatives are the target's log-softmax along the answer."""
    from test_logprobs import dense_logprobs

    tokenizer, target = served[1], served[2]
    messages = CHATS["colour"]
    ids = tokenizer.encode(messages)
    want = reference(served, [ids], 12)[0]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    out = client.chat.completions.create(**kwargs)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == len(want)
    expected = dense_logprobs(target, ids, want)
    np.testing.assert_allclose([c.logprob for c in content], expected[np.arange(len(want)), want], atol=1e-4)
    for entry, row in zip(content, expected):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(sorted(row)[::-1][:3], abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
    streamed = [c for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content

    prompt_ids = tokenizer.encode_text(PROMPTS[2])
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=2)
    report = completion.choices[0].logprobs
    tokens = reference(served, [prompt_ids], 8)[0]
    assert len(report.tokens) == len(report.token_logprobs) == len(report.top_logprobs) == len(tokens)
    np.testing.assert_allclose(report.token_logprobs, dense_logprobs(target, prompt_ids, tokens)[
        np.arange(len(tokens)), tokens], atol=1e-4)
    assert all(len(top) <= 2 for top in report.top_logprobs)
    assert report.text_offset == [sum(map(len, report.tokens[:k])) for k in range(len(tokens))]


def test_logit_bias_and_min_tokens(served, client):
    """A +100 bias makes its token the answer; min_tokens keeps the EOS (biased to win) away
    for that many tokens, the answer then ends with it."""
    biased = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                       logit_bias={"7": 100})
    assert biased.choices[0].text == chr(7 + 31) * 6
    held = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                     logit_bias={str(EOS): 100}, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    assert len(held.choices[0].text) == 5  # the EOS is not part of the text


def test_penalties_reach_the_engine(served, client):
    """The server's penalized greedy answer is the reference rule's over the dense target."""
    from test_penalties import reference_greedy

    tokenizer, target = served[1], served[2]
    prompt_ids = tokenizer.encode_text(PROMPTS[3])
    out = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0, frequency_penalty=2,
                                    presence_penalty=0.5, extra_body={"repetition_penalty": 1.5, "ignore_eos": True})
    want = reference_greedy(target, prompt_ids, 8, presence_penalty=0.5, frequency_penalty=2.0, repetition_penalty=1.5)
    assert out.choices[0].text == text_of(tokenizer, want)


def test_n_choices_whole_and_streamed(served, client):
    """n greedy choices are the greedy answer each; seeded sampled choices differ from one
    another, are the same streamed as whole, and choice i is a lone request with seed + i;
    usage counts the prompt once and every choice's tokens."""
    tokenizer = served[1]
    ids = tokenizer.encode(CHATS["two"])
    want = text_of(tokenizer, [t for t in reference(served, [ids], 12)[0] if t != EOS])
    greedy = client.chat.completions.create(model=MODEL, messages=CHATS["two"], max_tokens=12, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.message.content for c in greedy.choices] == [want] * 3
    assert greedy.usage.prompt_tokens == len(ids)
    assert greedy.usage.completion_tokens == 3 * len(reference(served, [ids], 12)[0])
    kwargs = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=-3)  # seeds may be negative
    whole = client.completions.create(**kwargs, n=4)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    streamed = [""] * 4
    for chunk in client.completions.create(**kwargs, n=4, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    alone = client.completions.create(**{**kwargs, "seed": -1})
    assert alone.choices[0].text == texts[2]


def test_a_repeated_prefix_is_served_from_the_cache(served, client):
    """A long prompt sent twice: the second answer reports its cached prompt tokens (whole
    pages of 16, at least the last token computed) and equals the first, acceptance included;
    the prefix-cache counters move by as much."""
    system = {"role": "system", "content": "You answer in one line. " * 6}
    messages = [system, {"role": "user", "content": "Count to five."}]
    before = metric_values(served[0])
    answers = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                              extra_body={"return_meta_info": True}) for _ in range(2)]
    after = metric_values(served[0])
    moved = lambda name: after.get((name, ()), 0) - before.get((name, ()), 0)
    prompt_tokens = answers[0].usage.prompt_tokens
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert cached[0] == 0 and cached[1] == (prompt_tokens - 1) // 16 * 16 > 100
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content
    meta = [a.model_extra["meta_info"] for a in answers]
    assert meta[1]["spec_accept_length"] == meta[0]["spec_accept_length"]
    assert moved("dflash_prefix_cache_queries_total") == 2 * prompt_tokens
    assert moved("dflash_prefix_cache_hits_total") == cached[1]


def test_zlab_dflash_generate_openai_runs_unchanged(served, capsys):
    """z-lab's `dflash generate openai` (dflash 0.1.0) prints the answer; its benchmark's reader
    finds usage and SGLang's meta_info."""
    pytest.importorskip("requests")
    from dflash import cli as zlab_cli
    from dflash.benchmark import send_openai

    tokenizer = served[1]
    question = CHATS["two"][0]["content"]
    want = reference(served, [tokenizer.encode([{"role": "user", "content": question}])], 24)[0]
    zlab_cli.main(["generate", "openai", "--model", MODEL, "--base-url", base_url(served[0]), "--max-new-tokens",
                   "24", question])
    assert capsys.readouterr().out == text_of(tokenizer, want) + "\n"
    out = send_openai(base_url(served[0]), [{"role": "user", "content": question}], model=MODEL, max_new_tokens=24,
                      temperature=0.0, top_p=1.0, top_k=0, timeout_s=60)
    meta = out["meta_info"]
    assert out["usage"]["completion_tokens"] == len(want)
    assert meta["spec_verify_ct"] >= 1 and 1 <= meta["spec_accept_length"] <= 4
    if out["choices"][0]["finish_reason"] == "length":  # the first token comes from prefill, not a cycle
        assert round(meta["spec_accept_length"] * meta["spec_verify_ct"]) == len(want) - 1


def test_sigterm_drains_every_stream_to_its_end(served):
    """Last in the module: it stops the server. With 4 streams running and 2 queued, the first
    SIGTERM (uvicorn's signal handler calls `handle_exit`) keeps the port open with /health
    draining and new requests refused, ends the queued streams with an error event before any
    token, lets the running ones that can finish do so (equal to offline decoding), ends the
    others at the drain's deadline with finish reason "abort", every stream with `[DONE]`, and
    the server exits."""
    server, tokenizer = served[0], served[1]
    loop = server.engine_loop
    engine, real_step = loop.engine, loop.engine.step
    steps, taken = threading.Semaphore(0), threading.Semaphore(0)  # a step allowed, a step begun

    def gated_step():
        assert steps.acquire(timeout=60)
        taken.release()
        return real_step()

    prompts = CONCURRENT[:6]
    short, long = 4, REFERENCE_TOKENS  # streams 0-2 end within 5 steps, 3-5 need at least 15
    max_tokens = [short] * 3 + [long] * 3
    want = reference(served, [tokenizer.encode_text(p) for p in prompts], REFERENCE_TOKENS)
    events: dict[int, list[dict | str]] = {i: [] for i in range(6)}

    def stream(i):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0, "stream": True}
        with httpx.stream("POST", base_url(server) + "/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))

    def step_until(done, what: str):
        """One step at a time (the next allowed once the last has begun) until `done()`."""
        deadline = time.monotonic() + 120
        while not done():
            assert time.monotonic() < deadline, what
            steps.release()
            assert taken.acquire(timeout=60), what
            time.sleep(0.2)

    engine.step = gated_step
    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        step_until(lambda: loop.num_open == 6 and engine.num_running == 4 and engine.num_waiting == 2,
                   "the engine did not fill its 4 slots")
        server.handle_exit(signal.SIGTERM, None)
        health = httpx.get(base_url(server) + "/health", timeout=300)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        late = httpx.post(base_url(server) + "/v1/completions", json={"prompt": "a"}, timeout=300)
        assert late.status_code == 503
        # The short streams end; the long ones have had their first tokens (or, queued, their error).
        step_until(lambda: all(events[i] and events[i][-1] == "[DONE]" for i in range(3))
                   and all(events[i] for i in range(3, 6)), "the short streams did not end")
        loop.drain(0.0)  # the drain's deadline now, with the long streams held mid-answer
        steps.release(1 << 20)
        for thread in threads:
            thread.join(120)
    finally:
        steps.release(1 << 20)
        del engine.step
    queued = {i for i in range(6) if "error" in events[i][0]}
    assert len(queued) == 2, events
    reasons = {}
    for i in range(6):
        assert events[i][-1] == "[DONE]", events[i]
        chunks = events[i][:-1]
        if i in queued:  # one error event, no token
            assert len(chunks) == 1 and chunks[0]["error"]["type"] == "server_unavailable", chunks
            continue
        reasons[i] = chunks[-1]["choices"][0]["finish_reason"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        if i < 3:  # short: finished before the deadline
            assert reasons[i] in ("length", "stop") and text == text_of(tokenizer, want[i][:short])
        else:  # long: held until the deadline, ended there with what it had
            full = text_of(tokenizer, want[i])
            assert reasons[i] == "abort" and text and full.startswith(text) and text != full
    assert any(i < 3 for i in reasons) and any(i >= 3 for i in reasons)  # 4 slots: some of each ran
    deadline = time.monotonic() + 60  # the server exits on its own once the streams are done
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        except OSError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server still accepts connections 60 s after its last stream ended")
