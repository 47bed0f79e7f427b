"""Run: the real training step (model, step options, parallel layouts), its dry run on fake tensors, and the
profiling child with its parent launcher. The only package that imports torch, CUDA, NVTX and NVML."""
