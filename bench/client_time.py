"""The time a request spends between client and engine (issue 55): where `workload.client`'s measured transport
defaults (sim/config/client.py: MEASURED_TRANSPORT) come from.

1. HTTP both ways on the stack `infersim serve --http` runs (Starlette on uvicorn, its listening socket) against this
   project's replay client (httpx, streaming, as calibration/endpoint.py sends): a server process that times each
   request's arrival at its handler and the end of its body's parsing and its prompt's tokenizing (in the event loop,
   as infersim's handler does), and stamps every server-sent event as it writes it; a client that times sending,
   every event's receipt and the stream's close. Both read time.perf_counter
   (CLOCK_MONOTONIC: one clock for both processes), so no offset is estimated. Per request: request path = body
   parsed at the server - sent; token delivery = received - written, per event; close = stream closed at the client -
   last token event received. The prompt is text of `--prompt` tokens (the body a real request carries); the server
   sends `--events` events `--gap-ms` apart (a decode step) and [DONE]. Then bursts of `--burst` requests sent at
   once: the gaps between their ends of parsing at the server are the server's serial work per request (a front end
   does one request at a time: transport.frontend_s and prompt_token_s).
2. Tokenization per prompt token and incremental detokenization per output token with a fast BPE tokenizer (HF
   tokenizers, SmolLM2's 49k vocabulary from the executor's cache), one thread.

The server runs on core 0 and the client on core 1 where there are two (as bench/http_serving.py), so that neither
takes the other's CPU. Everything here is one machine over loopback: a client across a network adds its round trip.

Usage: python bench/client_time.py [--requests 200] [--prompt 512] [--events 24] [--gap-ms 20]
Ends with `name: value` lines (times in microseconds).
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def serve(port_file: str) -> None:
    """The timing server (a process of its own): POST /v1/completions streams `max_tokens` stamped events."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from executor.api_server.server import SSE_HEADERS, bind

    tok = fast_tokenizer()

    async def completions(request: Request):
        entry = time.perf_counter()
        body = await request.json()
        tok.encode(body["prompt"], add_special_tokens=False)  # in the event loop, as infersim serve --http does
        parsed = time.perf_counter()
        n, gap = int(body["max_tokens"]), float(body["gap_s"])

        async def events():
            for k in range(n):
                if k:
                    await asyncio.sleep(gap)
                stamp = {"entry": entry, "parsed": parsed} if k == 0 else {}
                data = {"choices": [{"text": " tok", "index": 0, "finish_reason": None if k < n - 1 else "length"}],
                        "w": time.perf_counter(), **stamp}
                yield f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), headers=SSE_HEADERS, media_type="text/event-stream")

    async def cpu(request: Request):
        return JSONResponse({"cpu": time.process_time()})

    sock = bind("127.0.0.1", 0)
    Path(port_file).write_text(str(sock.getsockname()[1]))
    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/cpu", cpu)])
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)).run(sockets=[sock])


async def one(client, url: str, prompt: str, events: int, gap_s: float) -> dict:
    """One streamed request, timed on both sides."""
    body = {"model": "m", "prompt": prompt, "max_tokens": events, "gap_s": gap_s, "stream": True}
    recv, written, first = [], [], None
    sent = time.perf_counter()
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            first = first or data
            recv.append(now)
            written.append(data["w"])
    closed = time.perf_counter()
    return {"in_s": first["parsed"] - sent, "entry_s": first["entry"] - sent, "parsed_at": first["parsed"],
            "token_s": [a - b for a, b in zip(recv, written)], "close_s": closed - recv[-1]}


async def burst(url: str, prompt: str, size: int, rounds: int) -> list[float]:
    """`rounds` bursts of `size` requests sent at once: the gaps between their bodies' ends of parsing (and
    tokenizing) at the server, which does one request at a time: its serial cost per request."""
    import httpx

    gaps: list[float] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0)) as client:
        await asyncio.gather(*(one(client, url, prompt, 1, 0.0) for _ in range(size)))  # connections open
        for _ in range(rounds):
            got = await asyncio.gather(*(one(client, url, prompt, 1, 0.0) for _ in range(size)))
            parsed = np.sort([g["parsed_at"] for g in got])
            gaps += np.diff(parsed).tolist()
            await asyncio.sleep(0.05)
    return gaps


async def drive(url: str, prompt: str, requests: int, users: int, events: int, gap_s: float) -> tuple[list[dict],
                                                                                                    float, float]:
    """`users` closed-loop workers sending `requests` requests, each the next when one ends: (the timed requests, the
    server's and this client's CPU seconds per request)."""
    import httpx

    out: list[dict] = []
    issued = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0)) as client:
        await one(client, url, prompt, 2, 0.0)  # the connection, and the first request's imports, not timed
        cpu_url = url.replace("/v1/completions", "/cpu")
        server0, client0 = (await client.get(cpu_url)).json()["cpu"], time.process_time()

        async def worker():
            nonlocal issued
            while issued < requests:
                issued += 1
                out.append(await one(client, url, prompt, events, gap_s))

        await asyncio.gather(*(worker() for _ in range(users)))
        client1 = time.process_time()
        server1 = (await client.get(cpu_url)).json()["cpu"]
    return out, (server1 - server0) / requests, (client1 - client0) / requests


def fast_tokenizer():
    """SmolLM2's fast BPE tokenizer (HF tokenizers) from the executor's cache."""
    from tokenizers import Tokenizer

    found = glob.glob(str(Path.home() / ".cache" / "infersim" / "SmolLM2*" / "tokenizer.json"))
    if not found:
        raise SystemExit("no SmolLM2 tokenizer.json in ~/.cache/infersim: run `infersim serve` of a SmolLM2 scenario "
                         "once (it converts the GGUF and keeps the tokenizer)")
    return Tokenizer.from_file(found[0])


def tokenizer_costs(prompt_tokens: int) -> tuple[float, float, str]:
    """(seconds per prompt token to encode a prompt of `prompt_tokens`, seconds per token of incremental decoding,
    the prompt's text) with SmolLM2's fast tokenizer."""
    from tokenizers.decoders import DecodeStream

    tok = fast_tokenizer()
    corpus = tok.encode((ROOT / "executor" / "data" / "declaration_of_independence.txt").read_text()).ids
    ids = (corpus * (prompt_tokens // len(corpus) + 2))[:prompt_tokens]
    text = tok.decode(ids)
    n = len(tok.encode(text, add_special_tokens=False).ids)
    encode = []
    for _ in range(50):
        t = time.perf_counter()
        tok.encode(text, add_special_tokens=False)
        encode.append(time.perf_counter() - t)
    decode = []
    for _ in range(20):
        stream = DecodeStream(skip_special_tokens=True)
        t = time.perf_counter()
        for i in corpus[:512]:
            stream.step(tok, i)
        decode.append((time.perf_counter() - t) / 512)
    return statistics.median(encode) / n, statistics.median(decode), text


def http_costs(prompt: str, args):
    """Per user count, a closed loop against the timing server (drive); one user's requests of one event each (the
    CPU a request costs beyond its events); the gaps between requests of a burst at the server (burst)."""
    pin = len(os.sched_getaffinity(0)) >= 2
    port_file = Path(f"/tmp/client_time_port_{os.getpid()}")
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], cwd=ROOT,
                              preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if pin else None)
    if pin:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {0})
    try:
        for _ in range(200):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}/v1/completions"
        time.sleep(0.3)
        runs = {users: asyncio.run(drive(url, prompt, args.requests, users, args.events, args.gap_ms / 1e3))
                for users in args.users}
        one_event = asyncio.run(drive(url, prompt, args.requests, 1, 1, 0.0))
        return runs, one_event, asyncio.run(burst(url, prompt, args.burst, max(1, args.requests // args.burst)))
    finally:
        server.terminate()
        server.wait(timeout=10)
        port_file.unlink(missing_ok=True)


def spread(x: np.ndarray) -> float:
    """A robust coefficient of variation: the interquartile range over 1.349 (a normal's), over the median."""
    q1, q2, q3 = np.percentile(x, [25, 50, 75])
    return float((q3 - q1) / 1.349 / q2) if q2 > 0 else 0.0


def wall_figures(users: int, reqs: list[dict]) -> np.ndarray:
    """Print one closed loop's wall-clock figures; return each request's way in plus its first token's way out."""
    inn = np.array([r["in_s"] for r in reqs])
    tok = np.concatenate([r["token_s"] for r in reqs])
    close = np.array([r["close_s"] for r in reqs])
    print(f"users {users}: {len(reqs)} requests, {len(tok)} events (wall clock): way in p50 {np.median(inn) * 1e6:.0f} "
          f"us p90 {np.percentile(inn, 90) * 1e6:.0f}, token delivery p50 {np.median(tok) * 1e6:.0f} us p90 "
          f"{np.percentile(tok, 90) * 1e6:.0f}, close p50 {np.median(close) * 1e6:.0f} us", flush=True)
    tag = f"users{users}_"
    for name, x in (("way_in", inn), ("token_delivery", tok), ("close", close)):
        print(f"{tag}{name}_p50_us: {np.median(x) * 1e6:.1f}")
    return inn + np.array([r["token_s"][0] for r in reqs])


def transport(runs, one_event, gaps, costs, args) -> dict:
    """The transport's means from CPU time (what a busy machine inflates least): per request and per event on each
    side, from the closed loop of one user at `--events` events and at one event."""
    per_prompt_token, per_output_token = costs
    _, server_e, client_e = runs[1]
    _, server_1, client_1 = one_event
    per_event = ((server_e - server_1) + (client_e - client_1)) / (args.events - 1)
    tokenize = per_prompt_token * args.prompt
    front = server_1 - tokenize - per_event  # the server's own work on a request beyond its events and tokenizing
    return {"request_s": client_1 - per_event / 2, "frontend_s": max(front, 0.0), "prompt_token_s": per_prompt_token,
            "token_s": per_event + per_output_token, "close_s": per_event,
            "burst_gap_s": float(np.median(gaps)), "jitter_cv": spread(wall_figures(1, runs[1][0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (the request body's text)")
    ap.add_argument("--events", type=int, default=24, help="token events per request")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="between events: a decode step")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--burst", type=int, default=16, help="requests sent at once to time the server's serial work")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return
    per_prompt_token, per_output_token, prompt = tokenizer_costs(args.prompt)
    args.users = sorted(set(args.users) | {1})
    runs, one_event, gaps = http_costs(prompt, args)
    for users, (reqs, server_cpu, client_cpu) in runs.items():
        if users > 1:
            wall_figures(users, reqs)
        print(f"users{users}_cpu_per_request_us: server {server_cpu * 1e6:.1f}, client {client_cpu * 1e6:.1f}")
    print(f"one_event_cpu_per_request_us: server {one_event[1] * 1e6:.1f}, client {one_event[2] * 1e6:.1f}")
    t = transport(runs, one_event, gaps, (per_prompt_token, per_output_token), args)
    print(f"burst of {args.burst} sent at once: {t['burst_gap_s'] * 1e6:.0f} us between their ends of parsing at the "
          f"server (wall clock: both processes' serial work, and the machine's other load)", flush=True)
    for name in ("request_s", "frontend_s", "token_s", "close_s"):
        print(f"{name}_us: {t[name] * 1e6:.1f}")
    print(f"prompt_token_s_us: {per_prompt_token * 1e6:.3f}")
    print(f"detokenize_us_per_output_token: {per_output_token * 1e6:.3f}")
    print(f"burst_gap_us: {t['burst_gap_s'] * 1e6:.1f}")
    print(f"jitter_cv: {t['jitter_cv']:.3f}")
    print(f"load_avg_1min: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
