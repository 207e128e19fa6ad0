"""What-if: one scenario as widgets, simulated on demand: latency CDFs against the SLO, KV use and batch size over
time, throughput, goodput and cost, and the scenario YAML and report.json to download."""
import streamlit as st

from dashboard import background, form, results, seeds
from infersim import api
from sim.config.errors import ConfigError
from sim.config.plan import plan_of

st.title("What-if")
st.caption("Start from a scenario file, change any knob, simulate. Results are in seconds.")
seed = seeds.pick("whatif")
if seed is None:
    st.stop()
left, right = st.columns([2, 3], gap="large")
with left:
    data = form.scenario("whatif", seed.data)
with right:
    problem = None
    try:
        if data is not None:
            plan_of(data, seed.base_dir)  # a bad knob is reported as you set it, before any run
    except ConfigError as e:
        problem = e.one_line()
        st.error(problem)
    if st.button("Simulate", type="primary", key="whatif.run", disabled=data is None or problem is not None):
        try:
            outcome = background.run(lambda progress, cancel: api.simulate_data(
                data, seed.base_dir, progress=background.stoppable(progress, cancel)), "simulating", "whatif.cancel")
        except ConfigError as e:
            st.error(e.one_line())
        else:
            if outcome is not None:
                st.session_state["whatif.result"] = (data, seed.base_dir, outcome)
    if background.cancelled("whatif.cancel"):
        st.info("Cancelled.")
    done = st.session_state.get("whatif.result")
    if done is None:
        st.info("Press Simulate to run this scenario.")
    else:
        ran, _, outcome = done
        if ran != data:
            st.caption("The settings have changed since this run: press Simulate to see them.")
        results.show(outcome, ran, "whatif")
