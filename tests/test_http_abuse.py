"""`serve --http` as clients break it (issue 56): malformed and hostile bodies, prompts past max_model_len, hundreds
of streams at once, clients that vanish, half-open and slow sockets, a reader that stops, a missing API key, a SIGTERM
and an engine process that dies. Every request ends 2xx or a clear 4xx/429/503, nothing is left running, the counts
add up, and the server's memory does not grow with what clients send. A tiny random-weight model (tests/helpers)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from sim.config import environment
from tests.helpers import tiny_checkpoint, tiny_tokenizer, words, write_tiny_scenario
from tests.test_http_server import metric

KEY = "sk-test-abuse"
MAX_MODEL_LEN = 8192  # a long stream lasts ~10 s: many times the stall deadline, even on a loaded machine
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tiny_checkpoint(tmp_path_factory.mktemp("tiny-abuse"), seed=5, max_position_embeddings=MAX_MODEL_LEN)
    tiny_tokenizer(folder)
    return folder


def scenario(folder, checkpoint, name="abuse"):
    return write_tiny_scenario(folder, checkpoint, name=name, kv_cache={"num_blocks": 1200, "block_size": 8},
                               serving={"max_num_seqs": 8, "max_model_len": MAX_MODEL_LEN,
                                        "max_num_batched_tokens": MAX_MODEL_LEN})


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    from executor.api_server.limits import ServerLimits
    from executor.api_server.server import Running
    from infersim.api import http_server

    limits = ServerLimits(api_key=KEY, max_request_bytes=256 << 10, max_connections=256, request_timeout_s=3.0,
                          stall_timeout_s=1.0, shutdown_timeout_s=2.0, send_buffer_bytes=8 << 10)
    _, api = http_server(scenario(tmp_path_factory.mktemp("abuse"), checkpoint), "cpu", 1, served_model="tiny",
                         limits=limits)
    running = Running(api)
    yield running
    running.stop()


def client(running, key: str | None = KEY, timeout: float = 60) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=running.url, timeout=timeout, headers=headers)


def complete(c: httpx.Client, **body) -> httpx.Response:
    return c.post("/v1/completions", json={"prompt": words(6), "max_tokens": 3, "ignore_eos": True, **body})


def settled(running) -> str:
    """/metrics once nothing runs or waits (a dropped stream leaves the batch at the engine's next step)."""
    with client(running, None) as c:
        for _ in range(300):
            text = c.get("/metrics").text
            if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0:
                return text
            time.sleep(0.02)
    raise AssertionError("requests still running: " + text)


def counted(text: str, name: str, label: str) -> float:
    """The sum of a labelled counter's samples (0 if none yet)."""
    return sum(float(v) for v in re.findall(rf'^{re.escape(name)}{{[^}}]*{label}="[^"]*"}} (\S+)$', text, re.M))


def raw_post(running, body: bytes, headers: str = "") -> tuple[int, bytes]:
    """A POST sent byte for byte (bodies no client library would send): its status and body."""
    host, port = running.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: "
                  f"application/json\r\ncontent-length: {len(body)}\r\n{headers}\r\n".encode() + body)
        data = _read_response(s)
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        part = s.recv(65536)
        if not part:
            break
        data += part
    return data


def _length(data: bytes) -> int:
    m = re.search(rb"content-length: (\d+)", data.partition(b"\r\n\r\n")[0], re.I)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"prompt": "w7 w8", "temperature": NaN}', None),
    (b'{"prompt": "w7 w8", "top_p": Infinity}', None),
    (b'{"prompt": "w7 w8", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "w7 w8", "max_tokens": 1e999}', "max_tokens"),
    (b'{"prompt": "w7 w8", "max_tokens": ' + b"9" * 5000 + b"}", None),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    (b'{"prompt": "w7", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    (b'{"prompt": "w7", "temperature": ' + b"[" * 900 + b"]" * 900 + b"}", "temperature"),
    (b'{"prompt": "w7", "stream": "yes"}', "stream"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": [true, false]}', "prompt"),
    (b'{"prompt": "w7", "max_tokens": "12"}', "max_tokens"),
    (b'{"prompt": "w7", "stop": [1, 2]}', "stop"),
    (b'{"prompt": "w7", "stream_options": []}', "stream_options"),
    (b'["prompt", "w7"]', None),
    (b"\xff\xfe\x00garbage", None),
])
def test_malformed_bodies_get_400_naming_the_fault(server, body, param):
    status, raw = raw_post(server, body)
    assert status == 400, raw[:200]
    error = json.loads(raw)["error"]
    assert error["message"] and error["param"] == param


def test_prompts_past_max_model_len_are_refused_before_the_engine(server):
    with client(server) as c:
        before = c.get("/metrics").text
        ids = complete(c, prompt=[7] * MAX_MODEL_LEN)
        t = time.perf_counter()
        chars = complete(c, prompt="w7 " * 40_000)  # 120 kB: more characters than 8192 tokens of this vocabulary hold
        chars_s = time.perf_counter() - t
        full = complete(c, prompt=words(MAX_MODEL_LEN - 1), max_tokens=2)
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w7 " * 40_000}]})
        after = c.get("/metrics").text
    assert [r.status_code for r in (ids, chars, full, chat)] == [400] * 4
    assert ids.json()["error"]["param"] == "prompt" and chat.json()["error"]["param"] == "messages"
    assert chars_s < 1.0 and "characters" in chars.json()["error"]["message"]
    assert full.json()["error"]["param"] == "max_tokens"  # prompt + max_tokens past max_model_len: the scheduler's
    arrived = [metric(t, "infersim:requests_arrived_total") for t in (before, after)]
    assert arrived[1] - arrived[0] == 1  # only `full` reached the engine (and was rejected there)


def test_huge_bodies_get_413_unread_and_memory_stays_flat(server):
    """A body past --max-request-bytes is refused from its declared length, or as soon as a chunked one passes the
    bound; 64 MB sent either way leaves the server's memory where it was."""
    def chunks(total: int):
        part = b"w7 " * 21_845
        for _ in range(total // len(part)):
            yield part

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with client(server) as c:
        declared = c.post("/v1/completions", content=b"{" + b" " * (300 << 10) + b"}")
        t = time.perf_counter()
        chunked = c.post("/v1/completions", content=chunks(64 << 20), headers={"content-type": "application/json"})
        chunked_s = time.perf_counter() - t
        ok = complete(c)
    assert declared.status_code == 413 and chunked.status_code == 413 and ok.status_code == 200
    assert declared.json()["error"]["code"] == "request_too_large" and chunked_s < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 32 << 10  # KiB: under 32 MiB


def test_a_16_mb_prompt_does_not_stall_a_small_request(server):
    """While 16 MB of prompt is being sent, a two-token request is served as fast as alone."""
    def big():
        with client(server) as c:
            results.append(c.post("/v1/completions", content=b'{"prompt": "' + b"w7 " * ((16 << 20) // 3) + b'"}',
                                  headers={"content-type": "application/json"}).status_code)

    results: list = []
    with client(server) as c:
        complete(c, max_tokens=2)
        t = time.perf_counter()
        complete(c, max_tokens=2)
        alone = time.perf_counter() - t
        sender = threading.Thread(target=big)
        sender.start()
        t = time.perf_counter()
        small = complete(c, max_tokens=2)
        beside = time.perf_counter() - t
        sender.join(60)
    assert small.status_code == 200 and results == [413]
    assert beside < alone + 0.5


def test_hundreds_of_concurrent_streams_all_end_and_the_counts_add_up(server):
    n = 200

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = {"prompt": words(4 + i % 20, i), "max_tokens": 4, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        return r.status_code, len(events)

    async def all_at_once():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits,
                                     headers={"authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    before = settled(server)
    results = asyncio.run(all_at_once())
    after = settled(server)
    assert all(code == 200 and events == 5 for code, events in results), sorted(set(results))  # 4 tokens, [DONE]
    arrived = metric(after, "infersim:requests_arrived_total") - metric(before, "infersim:requests_arrived_total")
    done = counted(after, "vllm:request_success_total", "finished_reason") - counted(
        before, "vllm:request_success_total", "finished_reason")
    assert arrived == n == done and metric(after, "vllm:kv_cache_usage_perc") == 0


def test_clients_vanishing_mid_stream_free_their_requests(server):
    before = settled(server)
    for i in range(20):
        with client(server) as c, c.stream("POST", "/v1/completions", json={
                "prompt": words(10, i), "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    after = settled(server)
    gone = [counted(t, "infersim:requests_rejected_total", "reason") for t in (before, after)]
    assert gone[1] - gone[0] == 20 and metric(after, "vllm:kv_cache_usage_perc") == 0
    assert metric(after, "infersim:requests_rejected_total", reason="client disconnected") >= 20


def test_half_open_connections_cannot_starve_the_others(server):
    """256 connections (the limit) that never send a byte: while they hold the slots a request gets 503 at once;
    the request deadline (3 s here) closes them, and the server serves again."""
    host, port = server.url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(256)]
    try:
        time.sleep(0.2)
        with client(server) as c:
            t = time.perf_counter()
            full = complete(c)
            refused_s = time.perf_counter() - t
            time.sleep(3.5)
            served = complete(c)
        for s in socks:
            s.settimeout(5)
        closed = [s.recv(1024) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert full.status_code == 503 and refused_s < 1.0
    assert served.status_code == 200 and all(data == b"" for data in closed)


def test_a_request_sent_too_slowly_gets_408_while_others_are_served(server):
    host, port = server.url.removeprefix("http://").split(":")
    slow = socket.create_connection((host, int(port)))
    slow.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                 "content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"pro".encode())
    try:
        with client(server) as c:
            t = time.perf_counter()
            beside = complete(c)
            beside_s = time.perf_counter() - t
        slow.settimeout(10)
        t = time.perf_counter()
        answer = _read_response(slow)
        waited_s = time.perf_counter() - t
    finally:
        slow.close()
    assert beside.status_code == 200 and beside_s < 2.0
    assert answer.startswith(b"HTTP/1.1 408") and b"not sent in time" in answer and waited_s < 5


def test_a_client_that_stops_reading_is_dropped_and_its_kv_freed(server):
    """It asks for a long stream and reads nothing: once the server has held its bounded buffers for the stall
    deadline (1 s here), the stream is dropped and the request leaves the batch."""
    before = settled(server)
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    body = json.dumps({"prompt": words(4), "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True})
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: "
              f"application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}".encode())
    try:
        with client(server, None) as c:
            for _ in range(300):  # until it runs
                if metric(c.get("/metrics").text, "vllm:num_requests_running") == 1:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("the stream never ran")
        after = settled(server)
    finally:
        s.close()
    stalled = [counted(t, "infersim:requests_rejected_total", "reason") for t in (before, after)]
    finished = [counted(t, "vllm:request_success_total", "finished_reason") for t in (before, after)]
    assert (stalled[1] - stalled[0], finished[1] - finished[0]) == (1, 0)  # dropped, not run to its end first
    assert metric(after, "infersim:requests_rejected_total", reason="client stopped reading") >= 1
    assert metric(after, "vllm:kv_cache_usage_perc") == 0


def test_the_api_key_guards_every_route_but_health_and_metrics(server):
    with client(server, None) as c:
        bare = [c.post("/v1/completions", json={"prompt": "w7"}), c.get("/v1/models"),
                c.post("/tokenize", json={"prompt": "w7"}), c.post("/v1/chat/completions", json={})]
        open_ = [c.get("/health"), c.get("/metrics")]
    with client(server, "sk-wrong") as c:
        wrong = complete(c)
    with client(server) as c:
        right = complete(c)
    assert [r.status_code for r in bare] == [401] * 4 and wrong.status_code == 401
    assert bare[0].json()["error"]["type"] == "authentication_error"
    assert [r.status_code for r in open_] == [200, 200] and right.status_code == 200
    assert metric(open_[1].text, "infersim:requests_refused_total", status="401") >= 4


@pytest.mark.parametrize("args, env, message", [
    (["--api-key", "k"], None, "--api-key is a setting of an HTTP server: only with --http"),
    (["--stall-timeout", "5"], None, "--stall-timeout is a setting of an HTTP server"),
    (["--http", "--api-key", ""], None, "--api-key: an API key is printable ASCII"),
    (["--http", "--api-key", "two words"], None, "--api-key: an API key is printable ASCII"),
    (["--http"], "k\u00e9y", "INFERSIM_API_KEY: an API key is printable ASCII"),
    (["--http", "--request-timeout", "0"], None, "--request-timeout"),
    (["--http", "--max-request-bytes", "10"], None, "--max-request-bytes"),
])
def test_bad_front_flags_are_one_line_and_exit_2(tmp_path, checkpoint, monkeypatch, capsys, args, env, message):
    from infersim.cli import main

    if env is not None:
        monkeypatch.setenv("INFERSIM_API_KEY", env)
    with pytest.raises(SystemExit) as e:
        main(["serve", str(scenario(tmp_path, checkpoint)), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err


# -- shutting down: SIGTERM, and an engine process that dies -----------------------------------------------------------

def own_server(folder: Path, checkpoint, **limits):
    """A server of its own (these tests end it), keeping its trace."""
    from executor.api_server.limits import ServerLimits
    from executor.api_server.server import Running
    from infersim.api import http_server

    _, api = http_server(scenario(folder, checkpoint), "cpu", 1, served_model="tiny", keep_trace=True,
                         limits=ServerLimits(**limits))
    return Running(api)


def long_stream(url: str, events: list) -> threading.Thread:
    """A thread streaming a long answer into `events`, returned once its first token has come."""
    started = threading.Event()

    def run():
        with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json={
                "prompt": words(4), "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    started.wait(30)
    return thread


def test_sigterm_stops_taking_requests_and_cancels_the_rest_with_a_reason(tmp_path, checkpoint):
    running = own_server(tmp_path, checkpoint, shutdown_timeout_s=0.5)
    events: list = []
    with httpx.Client(base_url=running.url, timeout=60) as c:
        assert complete(c).status_code == 200
        reader = long_stream(running.url, events)
        running.uvicorn.handle_exit(signal.SIGTERM, None)
        time.sleep(0.05)
        try:
            late = complete(c).status_code  # on the connection kept alive: refused
        except httpx.TransportError:
            late = None  # the connection was closed: the listener too, so no new one
    assert late in (None, 503)
    reader.join(30)
    running.thread.join(30)
    assert not running.thread.is_alive()
    errors = [json.loads(e[6:])["error"]["message"] for e in events if '"error"' in e]
    assert errors and "server stopped" in errors[-1] and events[-1] == "data: [DONE]", (len(events), events[-3:])
    trace = running.server.served.client.trace
    assert [r.status.value for r in trace.requests] == ["finished", "rejected"]
    assert trace.requests[1].reject_reason == "server stopped"


def test_an_engine_process_that_dies_gets_503s_and_stops_the_server(tmp_path, checkpoint):
    running = own_server(tmp_path, checkpoint)
    codes: list = []

    def request():
        with client(running, None) as c:
            codes.append(complete(c, max_tokens=1500).status_code)

    sender = threading.Thread(target=request)
    sender.start()
    with client(running, None) as c:  # until it runs
        for _ in range(1000):
            if metric(c.get("/metrics").text, "vllm:num_requests_running") == 1:
                break
            time.sleep(0.01)
    os.kill(running.server.served.client.info["pid"], signal.SIGKILL)
    sender.join(30)
    running.thread.join(30)
    assert codes == [503] and not running.thread.is_alive()
    assert "the engine process stopped" in running.server.served.client.error


def start_cli(folder: Path, checkpoint, *flags: str) -> tuple[subprocess.Popen, str, int]:
    """`infersim serve --http` in a process of its own: (process, URL, the engine process's pid)."""
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "infersim.cli", "serve", str(scenario(folder, checkpoint)),
                             "--http", "--port", "0", *flags], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    said = ""
    for line in proc.stderr:
        said += line
        m = re.search(r"at (http://\S+)/v1 .*engine process (\d+)", said.replace("\n", " "))
        if m:
            return proc, m.group(1), int(m.group(2))
    raise AssertionError(f"the server did not start: {said}")


@pytest.mark.slow
@pytest.mark.skipif(not environment.long_tests(), reason="two servers as processes, ~20-45 s; their in-process twins "
                    "above run by default: INFERSIM_LONG=1 pytest ...")
def test_the_cli_exits_0_after_sigterm_and_1_when_its_engine_dies(tmp_path, checkpoint):
    """The same as a process: SIGTERM drains it and it exits 0, writing the report of what it served; its engine
    process killed, it exits 1 with one line saying so."""
    out = tmp_path / "out"
    proc, url, _ = start_cli(tmp_path / "a", checkpoint, "--shutdown-timeout", "0.5", "--out", str(out))
    events: list = []
    with httpx.Client(base_url=url, timeout=60) as c:
        assert complete(c).status_code == 200
    reader = long_stream(url, events)
    proc.send_signal(signal.SIGTERM)
    reader.join(30)
    assert proc.wait(30) == 0, proc.stderr.read()[-2000:]
    assert "server stopped" in events[-2] and events[-1] == "data: [DONE]"
    report = json.loads((out / "report.json").read_text())["requests"]
    assert report["arrived"] == 2 == report["completed"] + report["rejected"] and report["rejected"] == 1

    proc, url, engine_pid = start_cli(tmp_path / "b", checkpoint)
    os.kill(engine_pid, signal.SIGKILL)
    assert proc.wait(30) == 1
    assert "the engine process stopped" in proc.stderr.read()
