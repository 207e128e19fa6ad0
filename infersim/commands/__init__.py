"""The `infersim` commands, one module each (vLLM's entrypoints/ as the model): each imports what its command
needs and none imports another; what they share lies below them in infersim/ (inputs, progress, simulation,
scenario_keys, backends). infersim.api gathers their functions for Python callers; infersim.cli parses flags."""
