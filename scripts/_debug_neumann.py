import random, sys, torch
sys.path.insert(0, "tests")
from test_kernels import check_gdn_tree, _tree
from weaver_kernels.gdn_tree import chunk
for T in (37, 128):
    for kind in ("best_first", "chain"):
        for BV, nw, p in ((32, 4, "tf32x3"), (32, 8, "tf32"), (64, 4, "tf32")):
            err = check_gdn_tree(chunk, _tree(kind, T, random.Random(T)), 1, 16, 48, 128, 128, torch.bfloat16, True,
                                 seed=T, device="cuda", BV=BV, num_warps=nw, impl="neumann", precision=p)
            print(T, kind, BV, nw, p, {k: f"{v:.1e}" for k, v in err.items()}, flush=True)
