"""Depthwise causal conv1d over a tree: torch reference (naive) and Triton kernels (conv)."""
