"""The dashboard's four pages under Streamlit's AppTest: widgets changed, results asserted, and bad input shown as
the one-line message, never an exception."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboard" / "app.py"
SMALL = "scenarios/bursty_gamma_swap.yaml"  # 213 requests, swap preemptions: a small run with something to see
TINY_SEARCH = """
name: tiny
scenario:
  model: Llama-2-7B
  hardware: A100-80GB
  workload:
    seed: 1
    arrival: {process: poisson, rate: 2}
    num_requests: 100
    prompt_len: {dist: uniform, min: 100, max: 400}
    output_len: {dist: uniform, min: 20, max: 80}
  slo: {ttft_s: 1.0, tpot_s: 0.05}
target: {rate: 2}
space:
  hardware: [A100-80GB, L4]
  replicas: [1, 2]
search: {max_requests: 100, precision: 0.2}
"""


def open_page(page: str | None = None) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    if page:
        at.switch_page(page).run()
    assert_clean(at)
    return at


def assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.message for e in at.exception]


def widget(at: AppTest, kind: str, name: str, page: str = "whatif"):
    """The form's widget `name` (its key also holds the seed's digest: page::digest::name)."""
    found = [w for w in getattr(at, kind) if w.key and w.key.startswith(f"{page}::") and w.key.endswith(f"::{name}")]
    assert len(found) == 1, (kind, name, [w.key for w in getattr(at, kind)])
    return found[0]


def metrics(at: AppTest) -> dict[str, str]:
    """Each metric's figure, its note under `label note` and its tooltip under `label help`."""
    return {**{m.label: m.value for m in at.metric}, **{f"{m.label} note": m.delta for m in at.metric},
            **{f"{m.label} help": m.help for m in at.metric}}


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def simulate(at: AppTest) -> dict[str, str]:
    at.button(key="whatif.run").click().run()
    assert_clean(at)
    assert not errors(at)
    return metrics(at)


def whatif(seed: str = SMALL) -> AppTest:
    at = open_page()
    at.selectbox(key="whatif.seed.0").set_value(seed).run()
    assert_clean(at)
    return at


def test_whatif_simulates_and_follows_a_widget():
    at = whatif()
    assert "Press Simulate" in at.info[0].value
    first = simulate(at)
    assert first["Completed"] == "213" and first["Completed note"] == "0 rejected"
    assert first["TTFT p90"].endswith(" s") and first["$ per 1M output tokens"].startswith("$")
    assert len(at.get("plotly_chart")) == 2  # the latency CDFs, KV use and batch over time
    steps = at.dataframe[1].value  # where a typical prefill's and decode step's time goes
    assert list(steps.index)[0].startswith("prefill") and list(steps.index)[1].startswith("decode")
    assert (steps["total"] > 0).all() and any(c.value.startswith("Priced by: ") for c in at.caption)
    assert [b.proto.label for b in at.get("download_button")] == ["Download the scenario YAML", "Download report.json"]
    widget(at, "number_input", "replicas").set_value(3).run()
    assert any("settings have changed" in c.value for c in at.caption)
    again = simulate(at)
    hourly = float(first["$ per 1M output tokens note"].split()[0][1:])
    assert again["$ per 1M output tokens note"] == f"${3 * hourly:.2f} per hour"
    assert again["TTFT p90"] != first["TTFT p90"]
    at.switch_page("compare_page.py").run()  # the run just made is there to compare
    assert at.multiselect(key="compare.picked").options[0] == "What-if: the last simulated settings"


def test_whatif_policy_techniques_and_slo_widgets():
    at = whatif()
    widget(at, "number_input", "serving.max_num_seqs").set_value(4)
    widget(at, "selectbox", "serving.chunked").set_value("on")
    widget(at, "selectbox", "kv.preemption").set_value("recompute")
    widget(at, "number_input", "slo.ttft_s").set_value(0.05)
    widget(at, "toggle", "speculative.on").set_value(True).run()
    widget(at, "slider", "speculative.alpha").set_value(0.8)
    out = simulate(at)
    assert float(out["Goodput, req/s"]) > 0
    assert any("Speculative decoding: α 0.8" in c.value for c in at.caption)
    assert any(w.value.endswith("missed.") for w in at.warning)  # a 50 ms TTFT target
    # disaggregated pools instead of speculative decoding: one line per pool
    widget(at, "toggle", "speculative.on").set_value(False)
    widget(at, "toggle", "pools.on").set_value(True).run()
    widget(at, "number_input", "pools.decode.replicas").set_value(2)
    simulate(at)
    assert any(c.value.startswith("Decode pool: 2 ×") for c in at.caption)


def test_whatif_prefix_caching_on_prompts_that_share_a_prefix():
    at = whatif()
    widget(at, "checkbox", "kv.prefix_caching").check()
    widget(at, "number_input", "workload.prefix_len").set_value(256)
    widget(at, "number_input", "workload.num_prefixes").set_value(2)
    simulate(at)
    line = next(c.value for c in at.caption if c.value.startswith("Prefix caching:"))
    assert float(line.split(": ")[1].split("%")[0]) > 10


def test_whatif_conversations_resend_their_history_to_the_prefix_cache():
    at = whatif("scenarios/static_vs_continuous_continuous.yaml")  # 1 conversation/s fits an A100's cache
    widget(at, "checkbox", "kv.prefix_caching").check()
    widget(at, "checkbox", "workload.conversation").check().run()
    widget(at, "number_input", "workload.think_time_s").set_value(2.0)
    simulate(at)
    line = next(c.value for c in at.caption if c.value.startswith("Prefix caching:"))
    assert float(line.split(": ")[1].split("%")[0]) > 30  # each later turn finds the turn before it


def test_whatif_closed_loop_users_set_the_load():
    """A closed loop of users replaces the arrival rate: more users, more requests/s, at most the users in flight."""
    at = whatif()
    widget(at, "checkbox", "workload.closed_loop").check().run()
    flights = []
    for users in (2, 16):
        widget(at, "number_input", "workload.users").set_value(users)
        widget(at, "number_input", "workload.num_requests").set_value(120)
        simulate(at)
        line = next(c.value for c in at.caption if c.value.startswith("Closed loop:"))
        assert f"{users:,} users" in line
        flights.append(float(line.split("; ")[1].split(" requests in flight")[0]))
    assert 0 < flights[0] <= 2 < flights[1] <= 16
    widget(at, "checkbox", "workload.conversation").check().run()  # users holding conversations one after another
    simulate(at)
    captions = [c.value for c in at.caption]
    assert any(c.startswith("Closed loop: 16 users") for c in captions)
    assert any(c.startswith("Conversations: 120 of") for c in captions)


def memory_caption(at: AppTest) -> tuple[str, float, int]:
    """(its compression note, weights GiB, KV tokens) from the What-if's memory line."""
    line = next(c.value for c in at.caption if c.value.startswith("Memory per device"))
    note = line[len("Memory per device"):line.index(":")].strip(" ()")
    weights = float(line.split("weights ")[1].split(" GiB")[0])
    tokens = int(line.split("(")[-1].split(" tokens")[0].replace(",", ""))
    return note, weights, tokens


def test_whatif_compression_fits_a_bigger_model_and_frees_kv():
    at = whatif()
    widget(at, "selectbox", "model").set_value("Llama-2-70B")
    widget(at, "selectbox", "hardware").set_value("A100-80GB").run()
    assert any("does not fit" in e for e in errors(at)), errors(at)  # 70B in fp16 on one A100-80GB
    widget(at, "selectbox", "model.weight_dtype").set_value("int8").run()
    simulate(at)
    note, int8_weights, int8_tokens = memory_caption(at)
    assert note == "weight_dtype int8" and 60 < int8_weights < 70
    widget(at, "selectbox", "model.weight_dtype").set_value("int4").run()
    simulate(at)
    _, int4_weights, int4_tokens = memory_caption(at)
    assert int4_weights < 0.6 * int8_weights and int4_tokens > 2 * int8_tokens
    widget(at, "selectbox", "model.kv_dtype").set_value("int8").run()
    simulate(at)
    note, _, kv8_tokens = memory_caption(at)
    assert note == "weight_dtype int4, kv_dtype int8" and 1.8 < kv8_tokens / int4_tokens < 2.0


@pytest.mark.parametrize("change, where", [
    (lambda at: widget(at, "number_input", "parallel.tp").set_value(3), "parallel.tensor_parallel_size"),
    (lambda at: widget(at, "number_input", "serving.budget").set_value(16), "max_num_batched_tokens"),
    (lambda at: (widget(at, "toggle", "speculative.on").set_value(True), widget(at, "toggle", "pools.on")
                 .set_value(True)), "speculative decoding with pools"),
    (lambda at: widget(at, "number_input", "workload.rate").set_value(0.0), "workload.arrival.rate"),
    (lambda at: (widget(at, "selectbox", "workload.prompt_len.dist").set_value("uniform").run(),
                 widget(at, "number_input", "workload.prompt_len.min").set_value(5000)), "must be <= max"),
])
def test_whatif_bad_input_is_a_message(change, where):
    at = whatif()
    change(at)
    at.run()
    assert_clean(at)
    assert any(where in e for e in errors(at)), errors(at)
    assert at.button(key="whatif.run").disabled


def test_whatif_trace_workloads():
    at = whatif("default (embedded)")
    widget(at, "number_input", "workload.max_requests").set_value(300)
    widget(at, "number_input", "workload.time_scale").set_value(4.0).run()
    assert simulate(at)["Completed help"].startswith("of 300 arrived")
    widget(at, "selectbox", "workload.trace").set_value("upload a trace file").run()
    assert any("Upload an Azure LLM trace CSV" in i.value for i in at.info) and at.button(key="whatif.run").disabled
    rows = "".join(f"2023-11-16 18:15:{s:02d}.0000000,{100 + s},{20 + s}\n" for s in range(30))
    widget(at, "file_uploader", "workload.upload").set_value(
        ("mine.csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n{rows}".encode(), "text/csv")).run()
    assert simulate(at)["Completed"] == "30"
    lines = "".join(f'{{"timestamp": {250 * s}, "input_length": {100 + s}, "output_length": {20 + s}}}\n'
                    for s in range(12))
    widget(at, "file_uploader", "workload.upload").set_value(("mooncake.jsonl", lines.encode(), "text/plain")).run()
    assert simulate(at)["Completed"] == "12"
    widget(at, "file_uploader", "workload.upload").set_value(("bad.csv", b"when,what\n1,2\n", "text/csv")).run()
    at.button(key="whatif.run").click().run()
    assert_clean(at)
    assert any("missing column(s)" in e for e in errors(at)), errors(at)


def test_whatif_uploaded_scenario_and_a_broken_one():
    at = open_page()
    text = (ROOT / "scenarios/smollm2_cpu_small.yaml").read_bytes()
    at.file_uploader(key="whatif.upload").set_value(("mine.yaml", text, "application/x-yaml")).run()
    assert simulate(at)["Completed"] == "40"
    at.file_uploader(key="whatif.upload").set_value(("broken.yaml", b"model: [unclosed\n", "application/x-yaml"))
    at.run()
    assert_clean(at)
    assert errors(at) and errors(at)[0].startswith("broken.yaml")
    at.file_uploader(key="whatif.upload").set_value(("many.yaml", text + b"replicas: many\n", "application/x-yaml"))
    at.run()
    assert_clean(at)
    assert errors(at) and errors(at)[0].startswith("many.yaml: replicas:")


def test_validation_shows_shipped_runs_and_uploads():
    at = open_page("validation_page.py")
    assert at.multiselect(key="validation.files").value  # the runs under docs/runs
    capacity = 1 if at.multiselect(key="validation.capacity").value else 0  # the capacity table, if any is shipped
    assert len(at.dataframe) == len(at.multiselect(key="validation.files").value) + capacity
    shown = len(at.get("plotly_chart")) + len(at.get("image"))
    assert shown >= 1 + len(at.dataframe) - capacity  # the error bars, and a CDF overlay (or its PNG) per run
    cpu = next(p for p in at.multiselect(key="validation.files").options if "cpu" in p)
    data = json.loads((ROOT / cpu).read_text())
    at.multiselect(key="validation.files").set_value([])
    at.file_uploader(key="validation.upload").set_value([
        ("mine.validation.json", json.dumps(data).encode(), "application/json"),
        ("junk.json", b"{\"metrics\": 3}", "application/json")]).run()
    assert_clean(at)
    assert errors(at) == ["junk.json: no 'metrics' mapping: not a validation.json of `infersim validate`"]
    assert len(at.dataframe) == 1 + capacity and at.subheader[0].value == "mine.validation.json"
    assert len(at.get("plotly_chart")) == 2  # the error bars and this run's CDF overlay from its latency_cdf


def test_validation_shows_capacity_measured_against_predicted(tmp_path, monkeypatch):
    import dashboard.seeds

    runs = tmp_path / "runs" / "cap"
    runs.mkdir(parents=True)
    (runs / "capacity.json").write_text(json.dumps({
        "scenario": "s", "measured": {"capacity_rps": 4.0, "missed_at_rps": 4.2}, "predicted": {"capacity_rps": 4.2},
        "error_pct": 5.0, "predicted_at_run_speed": {"capacity_rps": 4.0}, "error_at_run_speed_pct": 0.0,
        "probes": [{"rate": 4.0, "passes": True, "sim_passes": True}, {"rate": 4.2, "passes": False,
                                                                        "sim_passes": True}]}))
    (tmp_path / "runs" / "bad").mkdir()
    (tmp_path / "runs" / "bad" / "capacity.json").write_text("{}")
    monkeypatch.setattr(dashboard.seeds, "REPO", tmp_path)
    at = open_page("validation_page.py")
    assert sorted(at.multiselect(key="validation.capacity").value) == ["runs/bad/capacity.json",
                                                                        "runs/cap/capacity.json"]
    assert errors(at) == ["runs/bad/capacity.json: measured: a mapping with capacity_rps (a number)"]
    table = at.dataframe[0].value
    assert table.loc["runs/cap/capacity.json", "predicted"] == 4.2
    assert table.loc["runs/cap/capacity.json", "unit"] == "req/s"  # files from before the unit was written
    assert table.loc["runs/cap/capacity.json", "verdicts agreeing"] == 1


def test_compare_two_configurations_on_one_workload():
    at = open_page("compare_page.py")
    pair = ["scenarios/static_vs_continuous_continuous.yaml", "scenarios/static_vs_continuous_static.yaml"]
    assert at.multiselect(key="compare.picked").value == pair
    at.button(key="compare.run").click().run()
    assert_clean(at)
    assert not errors(at)
    table = at.dataframe[0].value
    assert list(table.columns) == ["continuous-batching-paged", "static-batching-b8-contiguous"]
    assert len(at.get("plotly_chart")) == 3  # the CDFs overlaid, each one's KV and batch over time
    ttft = table.loc["TTFT p90 (s)"]
    assert ttft["continuous-batching-paged"] < ttft["static-batching-b8-contiguous"]
    widget(at, "number_input", "replicas", page=f"compare.{pair[0]}").set_value(2)
    widget(at, "number_input", "workload.num_requests", page="compare.workload").set_value(200).run()
    assert any("settings have changed" in c.value for c in at.caption)
    at.button(key="compare.run").click().run()
    again = at.dataframe[0].value
    assert list(again.loc["$ per hour"]) == [2 * table.loc["$ per hour"].iloc[0], table.loc["$ per hour"].iloc[1]]
    assert list(again.loc["completed"]) == [200, 200]
    for box in at.text_input:
        box.set_value("same")
    at.run()
    assert_clean(at)
    assert errors(at) == ["Two configurations have the same label: give each its own."]
    at.multiselect(key="compare.picked").set_value(pair[:1]).run()
    assert_clean(at)
    assert at.warning[0].value == "Pick two or more configurations to compare."


def searched(name: str, spec: str) -> AppTest:
    """The Search page after uploading `spec` and running it in one process, checked free of errors."""
    at = open_page("search_page.py")
    at.file_uploader(key="search.upload").set_value((name, spec.encode(), "application/x-yaml")).run()
    at.number_input(key="search.workers").set_value(1)
    at.button(key="search.run").click().run()
    assert_clean(at)
    assert not errors(at)
    return at


def test_search_runs_and_opens_a_configuration_in_whatif():
    at = searched("tiny.yaml", TINY_SEARCH)
    assert at.success[0].value.startswith("Recommended: hardware=A100-80GB replicas=1: 1 devices, $1.79/h")
    assert len(at.dataframe[0].value) == 4 and len(at.get("plotly_chart")) == 2  # cost vs capacity, vs TPOT
    at.selectbox(key="search.open.pick").set_value("hardware=A100-80GB replicas=2")
    at.button(key="search.open").click().run()
    assert_clean(at)
    assert at.title[0].value == "What-if"
    at.switch_page("whatif_page.py").run()  # where the browser now is (AppTest reruns the page it last switched to)
    assert at.selectbox(key="whatif.seed.1").value == "search: hardware=A100-80GB replicas=2"
    assert widget(at, "number_input", "replicas").value == 2
    assert simulate(at)["Completed"] == "100"


def test_search_of_a_closed_loop_counts_users():
    spec = TINY_SEARCH.replace("    arrival: {process: poisson, rate: 2}\n", "").replace(
        "    num_requests: 100\n", "    num_requests: 100\n    closed_loop: {users: 8, think_time_s: 1}\n").replace(
        "target: {rate: 2}", "target: {users: 8}")
    at = searched("users.yaml", spec)
    assert "users (target 8)" in at.success[0].value
    assert "capacity users" in at.dataframe[0].value.columns


def test_search_spec_errors_are_messages():
    at = open_page("search_page.py")
    at.file_uploader(key="search.upload").set_value(("tiny.yaml", TINY_SEARCH.encode(), "application/x-yaml")).run()
    at.text_area[0].set_value(TINY_SEARCH.replace("replicas: [1, 2]", "replica: [1, 2]")).run()
    assert_clean(at)
    assert errors(at)[0].startswith("tiny.yaml: space.replica: not a scenario key")
    assert not at.button


def test_app_serves_four_pages():
    at = open_page()
    for page in ("compare_page.py", "search_page.py", "validation_page.py", "whatif_page.py"):
        at.switch_page(page).run()
        assert_clean(at)
        assert at.title[0].value in {"What-if", "Compare", "Search", "Validation"}


def test_whatif_static_batching_drops_what_only_continuous_batching_reads():
    """The seed's max_num_seqs / chunked prefill are not carried into a static-batching scenario (which refuses
    keys it does not read), and come back with continuous batching."""
    at = whatif()
    widget(at, "selectbox", "serving.batching").set_value("static").run()
    assert not [w for w in at.selectbox if w.key and w.key.endswith("serving.chunked")]
    assert simulate(at)["Completed"]
    widget(at, "selectbox", "serving.batching").set_value("continuous").run()
    assert simulate(at)["Completed"]
