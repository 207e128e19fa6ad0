"""The device side: the llama-family model and its layers, attention, mixture-of-experts, weights, quantization and
sparsity, native kernels, KV tensors, CUDA graphs and sampling. Imports nothing else of the executor."""
