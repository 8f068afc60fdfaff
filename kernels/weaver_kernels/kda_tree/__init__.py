"""Tree Kimi Delta Attention (per-channel gated delta rule): torch references (naive), Triton verify (fused) and
commit."""
