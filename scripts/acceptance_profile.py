#!/usr/bin/env python
"""Teacher-forced accuracy of the drafters per depth, on the target's own greedy answers to MT-Bench / HumanEval.

Where a tree's mean accepted length comes from, without building trees: for every response position (the anchor,
i.e. the bonus token of a step) and every depth d, whether DFlash's marginal top-1, Weaver's top-1 along the realised
path, DFlash's top-k, or the candidate pool hold the realised token (``modeling_weaver.lab.training.acceptance_profile``
says what each column means). Weaver can beat trees of marginals (DDTree) only at depths ≥ 2, and only by as much
as its accuracy given the realised path exceeds the marginal's; a column of this table shows how much that is.

    python scripts/acceptance_profile.py --drafter checkpoints/smollm2-135m-instruct/dflash \\
        --weaver checkpoints/smollm2-135m-instruct/weaver --subset 8 --max-new-tokens 128 --out profile
"""

import argparse
import json
import sys
import time
from pathlib import Path

try:
    import modeling_weaver  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "kernels")]

import torch
from tqdm.auto import tqdm

from modeling_weaver.cli import existing_dir, existing_file, int_at_least, positive_int, torch_device
from modeling_weaver.lab.data import DATASET_TITLES, chat_prompt_ids, load_eval_prompts, load_prompt_file
from modeling_weaver.modeling_dflash import DFlashDraftModel
from modeling_weaver.modeling_weaver import WeaverModel
from modeling_weaver.output_dir import check_output, written_output
from modeling_weaver.lab.smollm2 import load_target, resolve_device, resolve_dtype
from modeling_weaver.lab.training import acceptance_profile

COLUMNS = ("dflash", "weaver", "dflash_given", "weaver_given", "dflash_reach", "weaver_reach", "dflash_topk", "pool")


def markdown(rows: list[dict], topk: int) -> str:
    names = {"dflash_topk": f"DFlash top-{topk}", "pool": "in pool", "dflash": "DFlash top-1", "weaver": "Weaver top-1",
             "dflash_given": "DFlash given a right chain", "weaver_given": "Weaver given a right chain",
             "dflash_reach": "DFlash chain reaches", "weaver_reach": "Weaver chain reaches"}
    lines = ["| depth | positions | " + " | ".join(names[c] for c in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for r in rows:
        cells = [f"{r[c]:.3f}" if c in r else "" for c in COLUMNS]
        lines.append(f"| {r['depth']} | {r['count']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="acceptance_profile.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", default="smollm2", help="'smollm2' (fetched/cached) or a transformers folder")
    parser.add_argument("--drafter", required=True, type=existing_dir, help="DFlash drafter folder")
    parser.add_argument("--weaver", default=None, type=existing_dir,
                        help="Weaver folder (without it the Weaver columns repeat DFlash)")
    parser.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"], choices=sorted(DATASET_TITLES))
    parser.add_argument("--prompts", default=None, type=existing_file,
                        help="JSONL of {prompt[, dataset, id]} to use instead of --datasets (e.g. make-data's "
                             "prompts-*.jsonl of a held-out seed: the drafters' own kind of prompt)")
    parser.add_argument("--subset", type=positive_int, default=8, help="first N prompts of each dataset")
    parser.add_argument("--max-new-tokens", type=int_at_least(2), default=128, help="length of each greedy answer")
    parser.add_argument("--topk", type=positive_int, default=8, help="the DFlash top-k column")
    parser.add_argument("--device", type=torch_device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="float32", help="target and drafters: float32 or bfloat16")
    parser.add_argument("--out", default=None,
                        help="folder for profile.json and profile.md: new, empty, or an earlier profile with "
                             "--overwrite")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it holds an earlier profile")
    args = parser.parse_args(argv)
    inputs = [args.target, args.drafter, args.weaver, args.prompts]
    if args.out:
        try:
            check_output(args.out, inputs, args.overwrite)  # before loading anything
        except (FileExistsError, ValueError) as err:
            parser.error(f"argument --out: {err}")

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target, tokenizer = load_target(args.target, dtype=dtype, device=device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(device).eval()
    weaver = WeaverModel.from_pretrained(args.weaver, dtype=dtype).to(device).eval() if args.weaver else None
    prompts = load_prompt_file(args.prompts) if args.prompts else load_eval_prompts(args.datasets)
    prompts = {ds: items[: args.subset] for ds, items in prompts.items()}

    start = time.time()
    sequences = {ds: [] for ds in prompts}
    bar = tqdm(total=sum(map(len, prompts.values())), desc="greedy answers")
    for ds, items in prompts.items():
        for item in items:
            ids = torch.tensor([chat_prompt_ids(tokenizer, item.text)], device=device)
            with torch.no_grad():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=args.max_new_tokens)
            sequences[ds].append((out[0].cpu(), ids.shape[1]))
            bar.update()
    bar.close()
    report = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(device)}
    text = []
    for ds, seqs in [*sequences.items(), ("all", [s for v in sequences.values() for s in v])]:
        rows = acceptance_profile(target, drafter, weaver, seqs, topk=args.topk)
        report[ds] = rows
        title = "all prompts" if ds == "all" else DATASET_TITLES.get(ds, ds)
        text.append(f"### {title}, {len(seqs)} answers\n\n{markdown(rows, args.topk)}")
    text.append(f"{report['date']}, {device}, {args.dtype}, {time.time() - start:.0f} s; "
                f"`{' '.join(sys.argv)}`")
    print("\n\n".join(text))
    if args.out:
        with written_output(args.out, inputs, args.overwrite) as out:
            (out / "profile.json").write_text(json.dumps(report, indent=1))
            (out / "profile.md").write_text("\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
