"""`infersim serve --http` on a tiny random-weight model with a word-level tokenizer: the OpenAI API (completions,
chat, streaming, usage, stop, seeds), many clients in one continuous batch, a client that goes away freeing its KV,
OpenAI-style 4xx errors, 429 under overload with every request accounted for, and /metrics under vLLM's names."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.helpers import tiny_checkpoint, tiny_tokenizer, words, write_tiny_scenario


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("tiny-http"), seed=7)
    tiny_tokenizer(folder)
    return folder


def start(tmp_path, checkpoint, **sections):
    from executor.api_server.server import Running
    from infersim.api import http_server

    _, server = http_server(write_tiny_scenario(tmp_path, checkpoint, name="http", **sections), "cpu", 1,
                            served_model="tiny", keep_trace=True)
    return Running(server)


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    running = start(tmp_path_factory.mktemp("srv"), checkpoint, serving={"max_num_seqs": 8})
    yield running
    running.stop()


def client(running) -> httpx.Client:
    return httpx.Client(base_url=running.url, timeout=60)


def metric(text: str, name: str, **labels) -> float:
    """A sample's value in the Prometheus text (the labels given must match)."""
    for line in text.splitlines():
        m = re.match(r"([^{ ]+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(name)


def stream_events(c: httpx.Client, path: str, body: dict) -> list:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completions_stream_a_chunk_per_token_and_end_with_usage(server):
    with client(server) as c:
        whole = c.post("/v1/completions", json={"model": "tiny", "prompt": words(12), "max_tokens": 6,
                                                "temperature": 0, "ignore_eos": True}).json()
        chunks = stream_events(c, "/v1/completions", {"prompt": words(12), "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True})
    assert whole["object"] == "text_completion" and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}
    assert len(chunks) == 6 and all(ch["choices"][0]["text"] for ch in chunks)
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None] * 5 + ["length"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["choices"][0]["text"]  # greedy: the same
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_uses_the_tokenizer_s_template_and_streams_deltas(server):
    messages = [{"role": "system", "content": words(3)}, {"role": "user", "content": words(5, 40)}]
    with client(server) as c:
        tokens = c.post("/tokenize", json={"messages": messages}).json()
        chunks = stream_events(c, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 4,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "stream_options": {"include_usage": True}})
    # <system> 3 words <user> 5 words <assistant>
    assert tokens["count"] == 11 and tokens["tokens"][0] == 5 and tokens["tokens"][-1] == 4
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum(1 for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")) == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 4,
                                                                   "total_tokens": 15}


def test_stop_strings_min_tokens_and_seeds(server):
    with client(server) as c:
        base = c.post("/v1/completions", json={"prompt": words(8), "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True}).json()["choices"][0]["text"].split()
        stopped = c.post("/v1/completions", json={"prompt": words(8), "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True, "stop": [base[3]]}).json()
        seeded = [c.post("/v1/completions", json={"prompt": words(8), "max_tokens": 8, "temperature": 1.0,
                                                  "seed": 11, "ignore_eos": True}).json()["choices"][0]["text"]
                  for _ in range(2)]
        held = c.post("/v1/completions", json={"prompt": words(8), "max_tokens": 30, "min_tokens": 30,
                                               "temperature": 1.0, "seed": 3}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"].split() == base[:base.index(base[3])]
    assert seeded[0] == seeded[1]
    assert held["usage"]["completion_tokens"] == 30  # EOS (id 2) masked until min_tokens


def test_concurrent_clients_share_one_continuous_batch_and_get_what_they_would_alone(server):
    """Eight clients at once: their decodes run in the same steps, and each gets the greedy tokens it gets alone."""
    prompts = [words(5 + 3 * i, 17 * i) for i in range(8)]
    with client(server) as c:
        alone = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0,
                                                 "ignore_eos": True}).json()["choices"][0]["text"] for p in prompts]
    with client(server) as c:
        before = c.get("/metrics").text
    together: list = [None] * len(prompts)
    at_once = threading.Barrier(len(prompts))  # sent together even where a loaded machine starts threads late

    def send(i):
        with client(server) as c:
            at_once.wait(30)
            together[i] = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 12, "temperature": 0,
                                                          "ignore_eos": True}).json()["choices"][0]["text"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with client(server) as c:
        after = c.get("/metrics").text
    assert together == alone
    wide = [metric(t, "infersim:decode_rows_per_step_count") - metric(t, "infersim:decode_rows_per_step_bucket",
                                                                        le="3.0") for t in (before, after)]
    assert wide[1] > wide[0]  # steps that decoded four or more of them at once


def test_a_client_that_goes_away_frees_its_kv_at_the_next_step(server):
    with client(server) as c:
        before = metric(c.get("/metrics").text, "infersim:requests_rejected_total", reason="client disconnected") \
            if "client disconnected" in c.get("/metrics").text else 0
        with c.stream("POST", "/v1/completions", json={"prompt": words(40), "max_tokens": 200, "temperature": 0,
                                                       "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            text = c.get("/metrics").text
            assert metric(text, "vllm:num_requests_running") == 1 and metric(text, "vllm:kv_cache_usage_perc") > 0
        for _ in range(200):  # the stream closed: out of the batch within a step or two
            text = c.get("/metrics").text
            if metric(text, "vllm:num_requests_running") == 0:
                break
            time.sleep(0.02)
    assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0
    assert metric(text, "infersim:requests_rejected_total", reason="client disconnected") == before + 1
    assert metric(text, "vllm:generation_tokens_total") > 0


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w7 w8", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w7 w8", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w7 w8", "n": 3}, 400, "n"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w7 w8", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w7 w8", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/embeddings", {"input": "x"}, 404, None),
])
def test_bad_requests_get_an_openai_style_error(server, path, body, status, param):
    with client(server) as c:
        r = c.post(path, content=body) if isinstance(body, str) else c.post(path, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_an_overloaded_server_answers_429_and_loses_nothing(tmp_path, checkpoint):
    """One sequence at a time, two waiting at most: of 12 clients at once the rest get 429 at once; nothing hangs,
    and the server's counts add up."""
    running = start(tmp_path, checkpoint, serving={"max_num_seqs": 1, "max_queue_len": 2})
    codes: list = []
    try:
        def send(i):
            with client(running) as c:
                codes.append(c.post("/v1/completions", json={"prompt": words(10, i), "max_tokens": 20,
                                                             "ignore_eos": True}).status_code)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        with client(running) as c:
            text = c.get("/metrics").text
            limited = c.post("/v1/completions", json={"prompt": "w9", "max_tokens": 2}).status_code
    finally:
        running.stop()
    assert len(codes) == 12 and set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 3
    assert limited == 200  # once the burst is served, it serves again
    arrived = metric(text, "infersim:requests_arrived_total")
    completed = sum(metric(text, "vllm:request_success_total", finished_reason=k) for k in ("length",)
                    if f'finished_reason="{k}"' in text)
    rejected = metric(text, "infersim:requests_rejected_total", reason="queue full (max_queue_len)")
    assert arrived == 12 == completed + rejected and rejected == codes.count(429)


def test_metrics_carry_vllm_s_names_and_the_requests_served(server):
    with client(server) as c:
        c.post("/v1/completions", json={"prompt": words(9), "max_tokens": 3, "ignore_eos": True})
        text = c.get("/metrics").text
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert f"# TYPE {name} " in text
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert f"# TYPE {name} histogram" in text and metric(text, f"{name}_count") > 0
        assert metric(text, f"{name}_bucket", le="+Inf") == metric(text, f"{name}_count")
    assert metric(text, "vllm:e2e_request_latency_seconds_count") == sum(
        metric(text, "vllm:request_success_total", finished_reason=k) for k in ("length", "stop")
        if f'finished_reason="{k}"' in text)
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256


def test_the_official_openai_client_streams_from_it(server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    stream = c.completions.create(model="tiny", prompt=words(10), max_tokens=5, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    texts = [ch.choices[0].text for ch in stream if ch.choices]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words(4)}], max_tokens=3,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert len(texts) == 5 and all(texts)
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt=words(3), max_tokens=4, temperature=9)


def test_accepted_connections_turn_nagle_off():
    """asyncio sets TCP_NODELAY only on sockets whose proto says TCP; an accepted socket takes the listener's. With
    proto 0, a stream's first chunk waited for the client's delayed ACK (~40 ms) after the response headers."""
    import asyncio
    import socket

    from executor.api_server.server import bind

    listener = bind("127.0.0.1", 0)
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        async def nodelay() -> int:
            transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, conn)
            value = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            transport.abort()
            return value

        assert asyncio.run(nodelay()) != 0
    finally:
        client.close()
        listener.close()
