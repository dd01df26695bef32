"""Routing kernels: a plain PyTorch reference and the fused Triton implementation beside it."""
