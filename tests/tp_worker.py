"""One rank of a tensor-parallel target run by ``test_distributed_targets.py`` (``torchrun``: gloo on CPU, NCCL on
GPUs, one per rank).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/tp_worker.py TARGET_DIR OUT_DIR

Loads the saved tiny target with ``tp_plan="auto"`` (transformers' tensor parallelism on DTensor), checks that its
attention projections really are split, runs ``target.generate`` greedy as the reference, then our loop in every mode
(the drafter replicated, and on rank 0 alone with the tree broadcast; through ``generate(custom_generate=...)``; and
sampling with one seed on every rank), and writes what it saw to ``OUT_DIR/rank-N.json`` for the test to judge.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).parent))

from test_generate import make_drafters, reference  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from modeling_weaver import generate, speculative_generate  # noqa: E402
from modeling_weaver.options import StepOptions  # noqa: E402
from modeling_weaver.target import AttentionLayerCache, TargetAdapter  # noqa: E402

NEW_TOKENS = 48


def main() -> None:
    target_dir, out_dir = map(Path, sys.argv[1:3])
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(target_dir, tp_plan="auto", dtype=torch.float32).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    attn = next(layer.self_attn for layer in target.model.layers if hasattr(layer, "self_attn"))
    weight = attn.k_proj.weight
    seen = {"rank": rank, "world": world, "transformers": transformers.__version__, "k_proj": type(weight).__name__,
            "k_local_rows": weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0],
            "k_rows": weight.shape[0]}
    cache = next(c for c in TargetAdapter(target, 64).layer_caches if isinstance(c, AttentionLayerCache))
    seen["kv_heads_here"] = cache.num_kv_heads
    seen["kv_heads"] = target.config.num_key_value_heads
    home = target.get_input_embeddings().weight.device  # (CPU under gloo; this rank's GPU under NCCL)
    drafter, weaver = (m.to(home) for m in make_drafters(target))  # (one seed on every rank: the same drafters)
    ids = torch.tensor([[5, 9, 17, 3, 44, 21, 8]], device=home)
    expected = reference(target, ids, NEW_TOKENS)
    seen["identical"] = {}
    for mode in ("chain", "ddtree", "weaver"):
        out = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                   max_new_tokens=NEW_TOKENS)
        seen["identical"][mode] = torch.equal(out, expected)
    calls = []
    hook = drafter.register_forward_hook(lambda *_: calls.append(1))
    for mode in ("ddtree", "weaver"):  # rank 0 drafts, the others receive its tree
        out = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=12,
                                   max_new_tokens=NEW_TOKENS, step_options=StepOptions(tp_drafter="rank0"))
        seen["identical"][f"{mode} rank0"] = torch.equal(out, expected)
    hook.remove()
    seen["drafter_calls_rank0"] = len(calls)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=generate, drafter=drafter,
                          weaver=weaver, mode="weaver", tree_budget=12, max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)
    seen["identical"]["custom_generate"] = torch.equal(out, expected)
    sampled = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="weaver", do_sample=True,
                                   temperature=0.8, max_new_tokens=NEW_TOKENS,
                                   generator=torch.Generator().manual_seed(7))
    seen["sampled"] = sampled[0].tolist()
    seen["greedy"] = expected[0].tolist()
    seen["device"] = str(home)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
