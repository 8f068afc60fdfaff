"""RMSNorm rows (transformers' Llama / Qwen3.5 / gated Qwen3.5 forms): torch reference (naive) and one Triton
kernel (fused)."""
