"""`infersim run` of a dense model on one replica set loads what it uses: no terminal library for its summary, and
none of the code only other layouts need (tests/test_startup.py checks the imports before a command runs)."""
import json
import subprocess
import sys

# what a plain run never uses: the summary is plain text; fitted profiles, hybrid KV groups, speculative decoding,
# pipelines and disaggregated pools are imported where a scenario asks for them
NOT_LOADED = ("rich", "sim.config.profile", "sim.cost.fitted", "sim.cost.parallel", "sim.config.kv_groups",
              "sim.policy.hybrid_allocator", "sim.cost.speculation", "sim.simulator.pipeline",
              "sim.simulator.disaggregated")


def test_the_default_run_prints_its_summary_and_loads_nothing_it_does_not_use(tmp_path):
    # the `infersim` process ends at once after its command (cli._end_process), its atexit hooks run
    code = ("import atexit, json, sys; sys.argv = ['infersim', 'run', '--no-plots']; from infersim.cli import main\n"
            "atexit.register(lambda: print(json.dumps(sorted(sys.modules))))\nmain()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    *summary, modules = r.stdout.splitlines()
    assert "┃ latency (ms), vLLM's ┃ mean" in "\n".join(summary)
    loaded = json.loads(modules)
    assert [m for m in NOT_LOADED if any(x == m or x.startswith(m + ".") for x in loaded)] == []
