import os

# Nothing may download weights or data at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One test's spinning OpenMP threads stall another process's steps (a spawned worker, a CPU burner) many times over:
# the suite's threads sleep when idle. Set before anything imports torch; the executor's own serve keeps its threads
# warm by busy work in idle gaps (executor.serving.serve keep_warm), not by the wait policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
