"""infersim's Python API: what the `infersim` commands do, callable from Python (the dashboard, the benches, a
notebook). Each command lives in its own module under infersim/commands/; this module gathers what callers use.
Every function raises ConfigError (one line: file, key path, what is allowed) for bad input.

- Simulate: `run_scenario` (a scenario file: report.json, requests.csv, plots), `simulate_data` (a scenario mapping:
  its `Outcome` kept whole), `load_plan` (a scenario file resolved), `default_scenario_path`.
- Plan: `load_search_spec` / `parse_search_spec` and `run_search` (the cheapest deployment meeting the SLOs),
  `compare_data` (configurations on one workload), `step_time` / `step_costs` (one step's price by part),
  `model_catalog`, `hardware_catalog`; `BACKENDS` a search may run on.
- Run the PyTorch executor: `serve_scenario` (replay a workload), `http_server` / `serve_http` (an OpenAI-compatible
  server; `server_limits` its HTTP front's bounds), `validate`, `validate_capacity`, `profile`, `distill`, `train_medusa`,
  `train_eagle`.
- Measure a running server or a published run, without torch: `validate_endpoint`, `profile_endpoint`,
  `validate_published`.
"""
from infersim.backends import BACKENDS
from infersim.commands.catalogs import hardware_catalog, model_catalog
from infersim.commands.compare import compare_data
from infersim.commands.profile import profile
from infersim.commands.profile_endpoint import profile_endpoint
from infersim.commands.run import run_scenario
from infersim.commands.search import load_search_spec, parse_search_spec, run_search
from infersim.commands.serve import http_server, serve_http, serve_scenario, server_limits
from infersim.commands.step_cost import step_costs, step_time
from infersim.commands.training import distill, train_eagle, train_medusa
from infersim.commands.validate import validate, validate_capacity
from infersim.commands.validate_endpoint import validate_endpoint
from infersim.commands.validate_published import validate_published
from infersim.inputs import default_scenario_path, load_plan
from infersim.simulation import Outcome, simulate_data
from sim.config.errors import ConfigError

__all__ = ["BACKENDS", "ConfigError", "Outcome", "compare_data", "default_scenario_path", "distill",
           "hardware_catalog", "http_server", "load_plan", "load_search_spec", "model_catalog", "parse_search_spec",
           "profile", "profile_endpoint", "run_scenario", "run_search", "serve_http", "serve_scenario", "server_limits",
           "simulate_data", "step_costs", "step_time", "train_eagle", "train_medusa", "validate", "validate_capacity",
           "validate_endpoint", "validate_published"]
