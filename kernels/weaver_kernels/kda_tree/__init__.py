"""Tree Kimi Delta Attention (per-channel gated delta rule): torch references (naive); kernels to follow."""
