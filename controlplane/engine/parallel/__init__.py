"""Running one model across several devices (controlplane/engine/parallel/tensor_parallel.py)."""
