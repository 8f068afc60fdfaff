"""Tree gated delta rule: torch reference (naive), Triton verify (chunk → fused / resident / neumann, chosen in
dispatch) and commit, one-token decode (fused_recurrent), mainline baseline."""
