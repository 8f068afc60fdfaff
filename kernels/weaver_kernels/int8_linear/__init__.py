"""A linear layer with int8 weights (one scale per output row) for a few input rows: torch reference (naive) and a
Triton kernel (skinny), which reads each weight byte once."""
