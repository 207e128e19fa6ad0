"""Multi-process execution: a launcher (launch.py), tensor parallelism (tensor_parallel.py) and pipeline
parallelism (pipeline.py) over torch.distributed, with shared-memory collectives on the CPU (shm.py)."""
