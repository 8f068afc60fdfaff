"""Tree attention over a committed KV cache plus the tree's own rows (split-KV Triton kernel, torch reference)."""
