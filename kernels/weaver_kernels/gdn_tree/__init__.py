"""Tree gated delta rule: torch reference (naive), Triton verify/commit (chunk), mainline baseline."""
