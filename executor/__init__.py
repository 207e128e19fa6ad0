"""infersim executor: a real PyTorch serving engine that runs the simulator's policy objects."""
