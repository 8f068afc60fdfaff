#!/usr/bin/env python
"""The Zoo v2 learning curve: one row per measured point of training, kept in a JSONL ledger.

    # compact read-out of acceptance_profile.py folders (what the device call prints)
    python scripts/zoo_curve.py summary WORK/profile-eval-x WORK/profile-heldout-x
    # add a point: greedy MAL from a `weaver bench` folder + profiles + how much training is behind it
    python scripts/zoo_curve.py record --ledger zoo/smollm2-135m-instruct/learning_curve.jsonl --label s1 \\
        --gpu-minutes 45.2 --data-tokens 25e6 --bench bench-s1 --profile-eval pe --profile-heldout ph
    # training tokens/s of runs side by side (after a warm-up), e.g. one GPU against eight (#32)
    python scripts/zoo_curve.py rate WORK/scale-1 WORK/scale-8 --skip 50
    # the table (markdown) and the plot (PNG) of every point
    python scripts/zoo_curve.py report --ledger zoo/smollm2-135m-instruct/learning_curve.jsonl \\
        --png zoo/smollm2-135m-instruct/learning_curve.png
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

METHODS = ("chain", "ddtree", "weaver")


def profile_point(folder: str | Path) -> dict:
    """Depth-1 top-1 and teacher-forced τ over all prompts of an ``acceptance_profile.py --out`` folder."""
    report = json.loads((Path(folder) / "profile.json").read_text())
    rows = report["all"]
    depth1 = next(r for r in rows if r["depth"] == 1)
    tau = next(r for r in rows if r["depth"] == "τ")
    return {"answers": report["args"]["subset"], "depth1_dflash": round(depth1["dflash"], 4),
            "depth1_weaver": round(depth1["weaver"], 4), "tau_dflash": round(tau["dflash"], 4),
            "tau_weaver": round(tau["weaver"], 4), "positions": depth1["count"]}


def bench_point(folder: str | Path) -> dict:
    """Greedy MAL per method@budget (mean over datasets, as `weaver bench` averages) and greedy identity."""
    rows = json.loads((Path(folder) / "results.json").read_text())["rows"]
    mal, identical = {}, True
    for r in rows:
        if r.get("temperature", 0) != 0 or r["mode"] not in METHODS:
            continue
        mal.setdefault(f"{r['mode']}@{r['budget']}", []).append(r["mal"])
        identical &= r.get("identical", 1.0) == 1.0
    return {"mal": {k: round(sum(v) / len(v), 4) for k, v in sorted(mal.items())}, "identical": identical}


def summary(args) -> int:
    for folder in args.folders:
        print(Path(folder).name, json.dumps(profile_point(folder)))
    return 0


def record(args) -> int:
    row = {"label": args.label, "date": args.date or time.strftime("%Y-%m-%d"), "gpu_minutes": args.gpu_minutes,
           "data_tokens": args.data_tokens, "note": args.note}
    if args.bench:
        row.update(bench_point(args.bench))
    if args.profile_eval:
        row["eval"] = profile_point(args.profile_eval)
    if args.profile_heldout:
        row["heldout"] = profile_point(args.profile_heldout)
    ledger = Path(args.ledger)
    rows = [json.loads(x) for x in ledger.read_text().splitlines()] if ledger.exists() else []
    if any(r["label"] == args.label for r in rows):
        raise SystemExit(f"{ledger} already has a point labelled {args.label!r}")
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with open(ledger, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 0


def training_rate(folder: str | Path, skip: int) -> dict:
    """Sequence tokens/s of a training run's ``train_log.jsonl`` (all ranks) from the first logged step past ``skip``
    to the last one: the first steps (allocation, autotuning) are not the steady rate."""
    rows = [json.loads(x) for x in (Path(folder) / "train_log.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens" in r]
    first = next((r for r in rows if r["step"] > skip), None)
    last = rows[-1] if rows else None
    if first is None or last is None or last["step"] == first["step"]:
        raise SystemExit(f"{folder}: too few logged steps past step {skip} for a rate")
    seconds = last["elapsed"] - first["elapsed"]
    if seconds <= 0:
        raise SystemExit(f"{folder}: no time logged between steps {first['step']} and {last['step']}")
    return {"steps": last["step"] - first["step"], "tokens": last["tokens"] - first["tokens"],
            "seconds": round(seconds, 2), "tokens_per_s": round((last["tokens"] - first["tokens"]) / seconds)}


def rate(args) -> int:
    base = None
    for folder in args.folders:
        r = training_rate(folder, args.skip)
        base = base or r["tokens_per_s"]
        print(f"{folder}: {json.dumps(r)}, {r['tokens_per_s'] / base:.2f}x the first")
    return 0


def table(rows: list[dict]) -> str:
    keys = [f"{m}@{b}" for b in (64, 16) for m in METHODS]
    head = ("| point | GPU-min | data tokens | " + " | ".join(f"MAL {k}" for k in keys)
            + " | W/chain@64 | W/DDTree@64 | depth-1 eval | depth-1 held-out | identical |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        mal = r.get("mal", {})
        cells = [f"{mal[k]:.2f}" if k in mal else "" for k in keys]
        ratio = (lambda a, b: f"{mal[a] / mal[b]:.2f}×" if a in mal and b in mal else "")
        acc = (lambda part: f"{r[part]['depth1_dflash']:.3f}" if part in r else "")
        lines.append(f"| {r['label']} | {r['gpu_minutes']:.1f} | {r['data_tokens'] / 1e6:.1f} M | "
                     + " | ".join(cells) + f" | {ratio('weaver@64', 'chain@64')} | {ratio('weaver@64', 'ddtree@64')}"
                     f" | {acc('eval')} | {acc('heldout')} | {'yes' if r.get('identical', True) else 'NO'} |")
    return "\n".join(lines)


def report(args) -> int:
    rows = [json.loads(x) for x in Path(args.ledger).read_text().splitlines() if x.strip()]
    print(table(rows))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        x = [r["gpu_minutes"] for r in rows]
        for key, style in (("weaver@64", "o-"), ("ddtree@64", "s-"), ("chain@64", "^-"), ("weaver@16", "o--"),
                           ("ddtree@16", "s--")):
            pts = [(xi, r["mal"][key]) for xi, r in zip(x, rows) if key in r.get("mal", {})]
            if pts:
                ax1.plot(*zip(*pts), style, label=key)
        ax1.set(xlabel="training GPU-minutes (H200)", ylabel="greedy MAL (8 MT-Bench + 8 HumanEval, 128 tokens)")
        ax1.legend()
        for part, style in (("eval", "o-"), ("heldout", "s-")):
            pts = [(xi, r[part]["depth1_dflash"]) for xi, r in zip(x, rows) if part in r]
            if pts:
                ax2.plot(*zip(*pts), style, label=f"DFlash depth-1 top-1, {part}")
        ax2.axhline(0.70, color="grey", lw=0.8, ls=":")
        ax2.set(xlabel="training GPU-minutes (H200)", ylabel="teacher-forced depth-1 top-1")
        ax2.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"plot: {args.png}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zoo_curve.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help="one line per acceptance_profile.py folder")
    p.add_argument("folders", nargs="+")
    p.set_defaults(func=summary)
    p = sub.add_parser("record", help="append a point to the ledger")
    p.add_argument("--ledger", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--gpu-minutes", type=float, required=True, help="training GPU-minutes behind the point (total)")
    p.add_argument("--data-tokens", type=float, required=True, help="tokens of generated data behind it (total)")
    p.add_argument("--bench", default=None, help="a `weaver bench --out` folder (greedy, budgets 64 and 16)")
    p.add_argument("--profile-eval", default=None, help="acceptance_profile.py folder on the eval prompts")
    p.add_argument("--profile-heldout", default=None, help="acceptance_profile.py folder on the held-out turns")
    p.add_argument("--date", default=None)
    p.add_argument("--note", default="")
    p.set_defaults(func=record)
    p = sub.add_parser("rate", help="training tokens/s of runs side by side (the first is the base)")
    p.add_argument("folders", nargs="+", help="training output folders (train_log.jsonl)")
    p.add_argument("--skip", type=int, default=50, help="steps of warm-up left out")
    p.set_defaults(func=rate)
    p = sub.add_parser("report", help="markdown table and PNG of the ledger")
    p.add_argument("--ledger", required=True)
    p.add_argument("--png", default=None, help="plot file to write (a new file, or --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --png")
    p.set_defaults(func=report)
    args = parser.parse_args(argv)
    if getattr(args, "png", None) and os.path.lexists(args.png) and not args.overwrite:
        p.error(f"argument --png: {args.png} already exists; pass --overwrite to replace it")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
