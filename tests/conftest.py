import torch

# The models under test are tiny: one thread avoids oversubscribing CI's two cores (and is faster at these sizes).
torch.set_num_threads(1)
