"""Clients no one here wrote against `infersim serve --http` (issue 48, 5a): the official `openai` Python client and
guidellm (an established benchmark client from PyPI) send the same load as infersim's own replay (`validate
--endpoint`'s client): 4 users back to back, 128-token prompts, 32-token outputs forced with ignore_eos. Their TTFT and
inter-token latency should agree with the replay's within 5%: what infersim measures of an endpoint is what others
measure of it. The three take turns, round by round (the order rotating), against one server; each figure is the
median over rounds of that run's median. On a small machine a client's own work (parsing streams, guidellm's
worker processes) would take cores from the server and change what it measures: by default the server runs on core 0
with one thread and the clients on the other cores (`--shared-cores` to share them).

guidellm reports per request (E2E − TTFT) / (tokens − 1) as its inter-token latency: vLLM's TPOT, compared with the
replay's TPOT; the openai loop's chunk gaps are compared with the replay's ITL too. guidellm runs from its own
environment (`--guidellm PATH`; pip install guidellm pulls torch 2.14 and more): without it, its rows are skipped.

Usage: python bench/endpoint_clients.py [--rounds 3] [--guidellm /path/to/venv/bin/guidellm] [--shared-cores]
Ends with `name: value` lines.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.endpoint import Prompts, connect, replay  # noqa: E402
from sim.config.generator import generate_requests  # noqa: E402
from sim.config.plan import load_scenario  # noqa: E402

SCENARIO = ROOT / "bench" / "scenarios" / "clients.yaml"


def start_server(path: Path, pin: bool) -> tuple[subprocess.Popen, str]:
    """The server; with `pin`, on core 0 with one thread, so that no client's work takes time from its steps."""
    threads = ["--threads", "1"] if pin else []
    server = subprocess.Popen([sys.executable, "-m", "infersim.cli", "serve", str(path), "--http", "--port", "0",
                               *threads], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                              preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if pin else None)
    for line in server.stderr:
        m = re.search(r"at (http://\S+)/v1", line)
        if m:
            return server, m.group(1)
    raise RuntimeError(f"the server did not start (exit code {server.wait()})")


def summary(ttft: list[float], tpot: list[float], itl: list[float], spans: list[tuple[float, float, float]]) -> dict:
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "tpot_p50_ms": 1e3 * statistics.median(tpot),
            "itl_p50_ms": 1e3 * statistics.median(itl) if itl else None, "requests": len(ttft),
            "prefills_per_decode": prefills_per_decode(spans)}


def prefills_per_decode(spans: list[tuple[float, float, float]]) -> float:
    """The load a client sent, as its requests saw it: per request (sent, first token, last token), the mean number
    of other requests whose prefill (sent to first token) overlaps its decode (first to last token). Requests sent
    in step decode together; requests out of step share their decodes with each other's prefills, which raises TPOT."""
    n = [sum(1 for j, (s2, f2, _) in enumerate(spans) if j != i and s2 < last and f2 > first)
         for i, (_, first, last) in enumerate(spans)]
    return statistics.mean(n)


def ours(url: str, specs) -> dict:
    ep = connect(url)
    try:
        outs = replay(ep, specs)
    finally:
        ep.close()
    assert all(o.finished for o in outs), [o.error for o in outs if not o.finished][:3]
    ttft = [o.token_times[0] - o.sent_s for o in outs]
    tpot = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1) for o in outs]
    itl = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:]) if b > a]
    return summary(ttft, tpot, itl, [(o.sent_s, o.token_times[0], o.token_times[-1]) for o in outs])


def openai_loop(url: str, model: str, texts: list[str], users: int, output_len: int) -> dict:
    """`users` workers, each sending the next prompt as soon as its last answer ended (the official client)."""
    import openai

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        todo = list(texts)
        ttft, tpot, itl, spans = [], [], [], []

        async def worker():
            while todo:
                prompt = todo.pop(0)
                t0 = time.perf_counter()
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len,
                                                         temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True, "min_tokens": output_len})
                times = []
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        times.append(time.perf_counter())
                assert len(times) == output_len, len(times)
                ttft.append(times[0] - t0)
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
                itl.extend(b - a for a, b in zip(times, times[1:]))
                spans.append((t0, times[0], times[-1]))

        await asyncio.gather(*(worker() for _ in range(users)))
        await client.close()
        return summary(ttft, tpot, itl, spans)

    return asyncio.run(run())


def guidellm_run(exe: str, url: str, model: str, tokenizer: Path, n: int, users: int, prompt_len: int,
                 output_len: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        spec = {"spec": {"backend": {"kind": "openai_http", "target": url, "model": model,
                                     "request_format": "/v1/completions"},
                         "profile": {"kind": "concurrent", "streams": users},
                         "data": [{"kind": "synthetic_text", "prompt_tokens": prompt_len, "output_tokens": output_len}],
                         "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
                         "constraints": [{"kind": "max_requests", "count": n}],
                         "outputs": [{"kind": "json", "path": str(out)}]}}
        (Path(tmp) / "scenario.json").write_text(json.dumps(spec))
        r = subprocess.run([exe, "run", "-c", str(Path(tmp) / "scenario.json"), "--disable-console-interactive"],
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed: {r.stderr[-400:]}")
        reqs = json.loads(out.read_text())["benchmarks"][0]["requests"]["successful"]
    assert len(reqs) >= n and all(q["output_tokens"] == output_len for q in reqs), [q["output_tokens"] for q in reqs]
    ttft = [q["time_to_first_token_ms"] / 1e3 for q in reqs]
    tpot = [q["inter_token_latency_ms"] / 1e3 for q in reqs]  # guidellm's ITL: (E2E - TTFT) / (tokens - 1)
    timings = [q["info"]["timings"] for q in reqs]
    spans = [(t["request_start"], t["first_token_iteration"], t["last_token_iteration"]) for t in timings]
    return summary(ttft, tpot, [], spans)


def save_tokenizer(folder: Path) -> Path:
    """The SmolLM2 tokenizer, out of the GGUF, as a folder guidellm's transformers loads."""
    from transformers import AutoTokenizer

    from executor.model.weights import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


def specs_for(users: int):
    """The bench scenario's requests with `users` in its closed loop."""
    _, plan = load_scenario(SCENARIO)
    loop = plan.workload.closed_loop.model_copy(update={"users": users})
    return generate_requests(plan.workload.model_copy(update={"closed_loop": loop}), plan.base_dir)


def measure(url: str, users: int, rounds: int, guidellm: str | None, tokenizer: Path | None) -> tuple[dict, list]:
    """Each client's medians over `rounds` rounds at `users` concurrent users, the order rotating; and the loads."""
    specs = specs_for(users)
    prompt_len, output_len = specs[0].prompt_len, specs[0].output_len
    ep = connect(url)
    model = ep.model
    prompts = Prompts(ep)
    texts = [prompts.text(prompt_len, s.id) for s in specs]
    ep.close()
    clients = {"infersim": lambda: ours(url, specs),
               "openai": lambda: openai_loop(url, model, texts, users, output_len),
               "guidellm": lambda: guidellm_run(guidellm, url, model, tokenizer, len(specs), users, prompt_len,
                                                output_len)}
    names = [n for n in clients if n != "guidellm" or guidellm]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    load = []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            got = clients[name]()
            runs[name].append(got)
            load.append(os.getloadavg()[0])
            print(f"users {users} round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()
                                                                     if v is not None)
                  + f" (load {load[-1]:.2f})", flush=True)
    med = {n: {k: statistics.median(x[k] for x in rs) for k in ("ttft_p50_ms", "tpot_p50_ms", "prefills_per_decode")}
           | {"itl_p50_ms": statistics.median(x["itl_p50_ms"] for x in rs) if rs[0]["itl_p50_ms"] else None}
           for n, rs in runs.items()}
    return med, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--users", default="1,4", help="comma-separated closed-loop sizes, each measured in turn")
    ap.add_argument("--guidellm", default=shutil.which("guidellm"))
    ap.add_argument("--shared-cores", action="store_true",
                    help="server and clients share every core (default: the server on core 0, the clients on the rest)")
    args = ap.parse_args()
    pin = not args.shared_cores and len(os.sched_getaffinity(0)) >= 2
    import openai

    server, url = start_server(SCENARIO, pin)
    if pin:  # the clients (guidellm's processes too) keep off the server's core
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {0})
    tmp = Path(tempfile.mkdtemp())
    results, load = {}, []
    try:
        tokenizer = save_tokenizer(tmp / "tok") if args.guidellm else None
        for users in (int(u) for u in args.users.split(",")):
            results[users], loads = measure(url, users, args.rounds, args.guidellm, tokenizer)
            load += loads
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"openai_version: {openai.__version__}")
    if args.guidellm:
        print(f"guidellm_version: {subprocess.run([args.guidellm, '--version'], capture_output=True, text=True).stdout.split()[-1]}")
    for users, med in results.items():
        for name, m in med.items():
            for k, v in m.items():
                if v is not None:
                    print(f"users{users}_{name}_{k}: {v:.2f}")
    for users, med in results.items():
        for name in med:
            if name == "infersim":
                continue
            for k in ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms"):
                if med[name].get(k) is not None:
                    print(f"users{users}_{name}_vs_infersim_{k.removesuffix('_ms')}_pct: "
                          f"{100 * (med[name][k] / med['infersim'][k] - 1):+.1f}")
    print(f"load_avg_1min: {statistics.mean(load):.2f}")
    print(f"server_pinned_to_one_core: {int(pin)}")


if __name__ == "__main__":
    main()
