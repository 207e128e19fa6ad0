"""What one scenario may ask of the tool, checked when it is validated, before anything is allocated: past these
a run would take minutes to hours or tens of GB before failing (docs/reference.md, "Limits", lists them)."""

MAX_REQUESTS = 2_000_000  # requests in one run (trace rows, num_requests, rate × duration_s, bursts): ~6 KB each
MAX_REPLICAS = 10_000
MAX_TOTAL_BLOCKS = 10_000_000  # KV blocks over all replicas (each replica keeps a free list of its block ids)
MAX_ARRIVAL_S = 1e8  # simulated seconds of arrivals (~3 years): the float clock still resolves microseconds there
MAX_LENGTH = 10_000_000  # tokens in one prompt or output
MAX_PROMPT_POOL = 1_000_000  # workload.shared_prefix's pool of prompts (prompts_per_prefix), each held
MAX_TRACE_BYTES = 256 * 2**20  # a trace CSV (the Azure conversation trace is under 1 MiB)
MAX_SCENARIO_BYTES = 4 * 2**20  # a scenario YAML file
MAX_YAML_NODES = 200_000  # values in a scenario with every alias expanded (a billion-laughs file: ~1e9)
MAX_YAML_DEPTH = 64  # nesting of a scenario's mappings and lists
MAX_YAML_STRING = 65_536  # characters in one value
