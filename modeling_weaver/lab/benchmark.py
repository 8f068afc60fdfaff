"""Benchmark: AR vs chain DFlash / DDTree / Weaver trees on MT-Bench and HumanEval (issue 4; docs/DESIGN.md §9).

For every dataset (prompts through the target's chat template) and every method — AR, then ``chain``, ``ddtree`` and
``weaver`` at each ``--budgets`` value — at each ``--temperatures`` value (0 = greedy; sampling uses target-only
verification for chain/DDTree and traversal for Weaver, or both with ``--sampling-verifications both``):

* **MAL** — tokens committed per target verify step, bonus included (Σ over prompts / Σ steps);
* **tokens/s** — new tokens / wall time of the whole generation (prefill included), CUDA synchronised;
* **speed-up** — tokens/s over *our* AR path at the same temperature on the same prompts.

Our AR path (:func:`autoregressive_generate`) decodes one token per step through the same
:class:`~modeling_weaver.target.TargetAdapter` (static pre-allocated KV cache, no HF generation overhead): the honest
baseline the speculative loop must beat, run with the same ``--target-step`` as the speculative path;
``--hf-baseline`` also times ``target.generate`` (HF eager) for reference. Every greedy run is checked token for token
against AR's output. Averages are the mean over datasets of the per-dataset figures.

Outputs in ``--out``: ``results.json`` (everything, per prompt too), ``table.md`` (printed) and ``plot.png`` (MAL
and speed-up vs budget; needs matplotlib, extra ``[bench]``).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .arguments import TREE_MODES, add_benchmark_arguments
from ..decoding.step_cache import capture_flags, static_target
from ..options import BudgetPolicy, StepOptions
from .data import (
    DATASET_TITLES,
    EvalPrompt,
    chat_prompt_ids,
    cli_entry,
    load_eval_prompts,
    load_prompt_file,
    require,
    require_dir,
)
from ..generate import PHASES, TARGET_STEPS, PhaseTimer, speculative_generate
from ..modeling_dflash import DFlashDraftModel
from ..modeling_weaver import WeaverModel
from ..output_dir import check_output, written_output
from ..packed import generation_packing
from ..tree import default_tree_budget
from .smollm2 import load_target, resolve_device, resolve_drafter_dtype, resolve_dtype
from ..target import TargetAdapter
from ..tree import Tree



@dataclass(frozen=True)
class Method:
    """One decoding configuration. ``budget`` is ``None`` for AR, or ``"auto"``; ``verification`` ``None`` = the
    loop's default."""

    mode: str
    budget: int | str | None = None
    temperature: float = 0.0
    verification: str | None = None

    @property
    def label(self) -> str:
        name = self.mode if self.budget is None else f"{self.mode}@{self.budget}"
        if self.temperature > 0:
            name += f" T={self.temperature:g}"
            if self.verification:
                name += f" ({self.verification})"
        return name


@dataclass
class PromptRun:
    prompt_id: str
    new_tokens: int
    steps: int  # target verify steps after the prefill
    committed: int  # tokens those steps committed (accepted drafts + bonus), as in SpeculativeStats
    seconds: float
    output: list[int] = field(repr=False)
    accepted_lengths: list[int] = field(default_factory=list, repr=False)  # per verify step (the replay's trace)
    phase_ms: dict = field(default_factory=dict)  # loop phases (draft, tree, verify, accept, commit), summed
    size_histogram: dict = field(default_factory=dict)  # draft nodes verified → steps
    calibration: dict | None = None  # budget auto: the step costs used


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_list(target) -> list[int]:
    eos = target.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def autoregressive_generate(target, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                            eos_token_id=None, generator: torch.Generator | None = None,
                            target_step: str = "eager", streamer=None,
                            step_options: StepOptions = StepOptions()) -> torch.Tensor:
    """Our AR baseline: one token per target step through :class:`TargetAdapter` (same caches as the tree loop).

    Args:
        input_ids: ``[1, T]`` prompt. temperature: 0 = greedy, else plain sampling at that temperature.
        eos_token_id: one id or several; default the target's generation config.
        streamer: a transformers streamer (``put``/``end``): the prompt, then each token as it reaches the host.
        target_step: ``"eager"``, ``"static"``, ``"graph"`` or ``"compiled"``, as in
            :func:`~modeling_weaver.generate.speculative_generate`. Greedy fixed-shape decoding runs one
            :class:`~modeling_weaver.decoding.fused.FusedARStep` per token (verify, commit and argmax in one CUDA graph on
            CUDA, launched before the host reads the previous token).
        step_options: how the target's kernels run (:class:`~modeling_weaver.options.StepOptions`).
    Returns:
        ``[1, T + new]`` ids (greedy output equals ``target.generate(do_sample=False)``).
    """
    with generation_packing(step_options, input_ids.device, [target], target_step):  # (as the tree loop runs)
        return _autoregressive(target, input_ids, max_new_tokens, temperature, eos_token_id, generator, target_step,
                               streamer, step_options)


def _autoregressive(target, input_ids, max_new_tokens, temperature, eos_token_id, generator, target_step, streamer,
                    step_options):
    eos = set(_eos_list(target) if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int)
              else eos_token_id)
    max_length = input_ids.shape[1] + max_new_tokens + 1
    if target_step == "eager":
        adapter = TargetAdapter(target, max_length=max_length, options=step_options)
    else:
        adapter = static_target(target, max_length, 1, **capture_flags(target_step, input_ids.device),
                                options=step_options)
    new: list[int] = []

    def emit(tok: int) -> None:
        new.append(tok)
        if streamer is not None:
            streamer.put(torch.tensor([tok]))

    if streamer is not None:
        streamer.put(input_ids.cpu())
    logits = adapter.prefill(input_ids[0]).logits[-1]
    if target_step != "eager" and temperature == 0:  # one fixed-shape step per token, pipelined when captured
        emit(int(logits.argmax()))
        step = adapter.ar_step()
        step.seed(new[0])
        # a step ahead only for a wanted token
        with contextlib.closing(step.run(ahead=lambda: len(new) + 1 < max_new_tokens)) as steps:
            while new[-1] not in eos and len(new) < max_new_tokens:
                emit(next(steps))
    else:
        while True:
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, -1).cpu()
                emit(int(torch.multinomial(probs, 1, generator=generator)))
            else:
                emit(int(logits.argmax()))
            if new[-1] in eos or len(new) >= max_new_tokens:
                break
            logits = adapter.verify(Tree.from_lists([new[-1]], [-1], device=input_ids.device)).logits[0]
            adapter.commit([0])
    if streamer is not None:
        streamer.end()
    return torch.cat([input_ids, input_ids.new_tensor([new])], dim=1)


def run_prompt(method: Method, target, drafter, weaver, input_ids: torch.Tensor, max_new_tokens: int,
               seed: int, target_step: str = "eager", recalibrate: bool = False) -> PromptRun:
    """Generate for one prompt under ``method``, timed (CUDA synchronised); ``recalibrate``: budget auto measures
    its step costs again."""
    device = input_ids.device
    generator = torch.Generator().manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    if method.mode == "ar":
        ids = autoregressive_generate(target, input_ids, max_new_tokens, temperature=method.temperature,
                                      generator=generator, target_step=target_step)
        steps = committed = ids.shape[1] - input_ids.shape[1] - 1
    elif method.mode == "hf":
        ids = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                              do_sample=False)
        steps = committed = ids.shape[1] - input_ids.shape[1] - 1
    else:
        sample = method.temperature > 0
        ids, stats = speculative_generate(
            target, input_ids, drafter=drafter, weaver=weaver, mode=method.mode, tree_budget=method.budget,
            max_new_tokens=max_new_tokens, do_sample=sample, temperature=method.temperature if sample else 1.0,
            verification=method.verification if sample else None, generator=generator, return_stats=True,
            target_step=target_step, timer=PhaseTimer(device),
            budget_policy=BudgetPolicy(recalibrate=recalibrate) if method.budget == "auto" else None,
        )
        steps, committed = stats.num_steps, sum(stats.accepted_lengths)
    _sync(device)
    seconds = time.perf_counter() - start
    new = ids[0, input_ids.shape[1]:].tolist()
    if method.mode in ("ar", "hf"):
        return PromptRun("", len(new), steps, committed, seconds, new)
    return PromptRun("", len(new), steps, committed, seconds, new, stats.accepted_lengths, stats.phase_ms,
                     stats.size_histogram, stats.calibration and stats.calibration["costs"])


def build_methods(modes, budgets, temperatures, sampling_verifications: str = "default",
                  hf_baseline: bool = False) -> list[Method]:
    """Per temperature: AR first (the baseline), then every budget (in the order given) × tree mode.

    Budget-outer order puts the modes' comparison at one budget next to each other, so a run cut short by
    ``--max-minutes`` still compares them at the first budgets listed.
    """
    methods = []
    for temp in temperatures:
        methods.append(Method("ar", None, temp))
        if hf_baseline and temp == 0:
            methods.append(Method("hf", None, 0.0))
        for budget in budgets:
            for mode in modes:
                if temp > 0 and sampling_verifications == "both":
                    methods += [Method(mode, budget, temp, v) for v in ("target_only", "traversal")]
                else:
                    methods.append(Method(mode, budget, temp))
    return methods


def summarize(method: Method, runs: list[PromptRun], ar_runs: list[PromptRun] | None) -> dict:
    tokens = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    steps = sum(r.steps for r in runs)
    mal = sum(r.committed for r in runs) / max(1, steps)  # SpeculativeStats.mean_accepted_length, pooled
    row = {"method": method.label, **asdict(method), "prompts": len(runs), "new_tokens": tokens, "steps": steps,
           "seconds": round(seconds, 4), "mal": round(mal, 4), "tokens_per_s": round(tokens / max(seconds, 1e-9), 2)}
    if method.budget == "auto":  # the sizes chosen, and the step costs they were chosen by
        sizes: dict[int, int] = {}
        for r in runs:
            for size, n in r.size_histogram.items():
                sizes[size] = sizes.get(size, 0) + n
        row["size_histogram"] = dict(sorted(sizes.items()))
        row["calibration"] = runs[-1].calibration
    phases = {k for r in runs for k in r.phase_ms}
    if phases:  # ms per verify step, by loop phase
        row["step_ms"] = {k: round(sum(r.phase_ms.get(k, 0.0) for r in runs) / max(1, steps), 3) for k in
                          sorted(phases)}
    if ar_runs is not None:
        ar_tps = sum(r.new_tokens for r in ar_runs) / max(sum(r.seconds for r in ar_runs), 1e-9)
        row["speedup"] = round(row["tokens_per_s"] / ar_tps, 3)
        if method.temperature == 0:
            same = [r.output == a.output for r, a in zip(runs, ar_runs)]
            row["identical"] = sum(same) / len(same)
            row["mismatched_prompts"] = [r.prompt_id for r, s in zip(runs, same) if not s]
    return row


def _fmt(x, digits=2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(rows: list[dict], datasets: list[str]) -> str:
    """One line per method: MAL, tokens/s and speed-up per dataset, then the averages and greedy identity."""
    head = ["T", "method", "budget"]
    for ds in datasets:
        title = DATASET_TITLES.get(ds, ds)
        head += [f"{title} MAL", f"{title} tok/s", f"{title} ×AR"]
    head += ["avg MAL", "avg tok/s", "avg ×AR", "identical to AR"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_method: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], {})[r["dataset"]] = r
    for label, per_ds in by_method.items():
        any_row = next(iter(per_ds.values()))
        cells = [f"{any_row['temperature']:g}", label.split(" ")[0].split("@")[0]
                 + (f" ({any_row['verification']})" if any_row["verification"] else ""),
                 str(any_row["budget"] or "–")]
        for ds in datasets:
            r = per_ds.get(ds, {})
            cells += [_fmt(r.get("mal")), _fmt(r.get("tokens_per_s"), 1), _fmt(r.get("speedup"))]
        vals = list(per_ds.values())

        def mean(key, vals=vals):
            return sum(v[key] for v in vals) / len(vals) if all(key in v for v in vals) else None

        ident = [(v.get("identical"), v["prompts"]) for v in vals]
        same = round(sum(i * n for i, n in ident)) if ident[0][0] is not None else None
        total = sum(n for _, n in ident)
        ident_cell = "–" if same is None else ("yes" if same == total else f"NO ({same}/{total} prompts)")
        cells += [_fmt(mean("mal")), _fmt(mean("tokens_per_s"), 1), _fmt(mean("speedup")), ident_cell]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    """Per tree method and dataset: ms per verify step in each loop phase (draft, tree, verify, accept, commit)."""
    lines = ["| method | dataset | " + " | ".join(f"{p} ms" for p in PHASES) + " | total ms |",
             "|" + "---|" * (len(PHASES) + 3)]
    for r in rows:
        if "step_ms" in r:
            cells = [r["step_ms"].get(p) for p in PHASES]
            lines.append(f"| {r['method']} | {DATASET_TITLES.get(r['dataset'], r['dataset'])} | "
                         + " | ".join(_fmt(c) for c in cells) + f" | {_fmt(sum(c or 0.0 for c in cells))} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path):
    """MAL and speed-up vs budget (averaged over datasets), one line per mode × temperature × verification."""
    require("matplotlib", "bench", "the benchmark plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple, dict[int, list[dict]]] = {}
    for r in rows:
        if not isinstance(r["budget"], int):  # (AR, and auto: no one budget to plot it at; the table has it)
            continue
        series.setdefault((r["mode"], r["temperature"], r["verification"]), {}).setdefault(r["budget"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, temp, ver), by_budget in sorted(series.items(), key=lambda kv: (kv[0][1], kv[0][0], str(kv[0][2]))):
        budgets = sorted(by_budget)
        label = mode + (f" T={temp:g}" if temp else " greedy") + (f" ({ver})" if ver else "")
        style = "-" if temp == 0 else "--"
        for ax, key in zip(axes, ("mal", "speedup")):
            ys = [sum(r[key] for r in by_budget[b]) / len(by_budget[b]) for b in budgets]
            ax.plot(budgets, ys, style, marker="o", label=label)
    ticks = sorted({r["budget"] for r in rows if isinstance(r["budget"], int)})
    for ax, title in zip(axes, ("mean accepted length (MAL)", "speed-up over our AR")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tree budget (draft nodes)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_benchmark_suite(target, tokenizer, drafter, weaver, prompts: dict[str, list[EvalPrompt]],
                        methods: list[Method], max_new_tokens: int, seed: int = 0, progress: bool = True,
                        max_minutes: float | None = None, on_method=None, target_step: str = "eager",
                        recalibrate: bool = False) -> list[dict]:
    """Run every method on every prompt; one summary row per (dataset, method).

    ``on_method(rows)`` is called after each method (the CLI saves partial results there). With ``max_minutes``,
    no new method starts after that time: the rows of the methods that finished are returned. Budget auto measures
    its step costs in the method's warm-up when they are not cached (``recalibrate``: always).
    """
    from tqdm.auto import tqdm

    start = time.monotonic()
    device = next(target.parameters()).device
    encoded = {ds: [(p.id, torch.tensor([chat_prompt_ids(tokenizer, p.text)], device=device)) for p in items]
               for ds, items in prompts.items()}
    rows = []
    total = sum(len(v) for v in encoded.values()) * len(methods)
    bar = tqdm(total=total, desc="benchmark", unit="gen", disable=not progress)
    for method in methods:
        if max_minutes is not None and time.monotonic() - start > 60 * max_minutes:
            print(f"--max-minutes {max_minutes} reached: skipped {len(methods) - methods.index(method)} of "
                  f"{len(methods)} methods")
            break
        first = next(iter(encoded.values()))[0][1]
        run_prompt(method, target, drafter, weaver, first, min(8, max_new_tokens), seed, target_step,  # warm-up
                   recalibrate)
        for ds, items in encoded.items():
            runs = []
            for i, (pid, ids) in enumerate(items):
                run = run_prompt(method, target, drafter, weaver, ids, max_new_tokens, seed + i, target_step)
                run.prompt_id = pid
                runs.append(run)
                bar.update(1)
                bar.set_postfix_str(f"{ds} {method.label}")
            ar = None if method.mode == "ar" else next(
                (r["_runs"] for r in rows if r["dataset"] == ds and r["mode"] == "ar"
                 and r["temperature"] == method.temperature), None)
            row = summarize(method, runs, ar if method.mode != "ar" else runs)
            row.update(dataset=ds, _runs=runs)
            rows.append(row)
        if on_method is not None:
            on_method(rows)
    bar.close()
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# CLI.
# ----------------------------------------------------------------------------------------------------------------------


def default_budgets(device) -> list[int]:
    """``--budgets`` when none are given: 16, 32 and 64 on CUDA; elsewhere the device's default budget only (larger
    trees cost more than they bring on a CPU, :func:`~modeling_weaver.tree.default_tree_budget`)."""
    return [16, 32, 64] if torch.device(device).type == "cuda" else [default_tree_budget(device)]


@cli_entry
def run_benchmark(args) -> int:
    if not args.no_plot:
        require("matplotlib", "bench", "the benchmark plot (or pass --no-plot)")
    if args.modes and args.drafter is None:
        raise ValueError("--drafter is required for the chain/ddtree/weaver modes")
    if "weaver" in args.modes and args.weaver is None:
        raise ValueError("--weaver is required for the weaver mode (or drop it from --modes)")
    require_dir(args.drafter, "--drafter")
    require_dir(args.weaver, "--weaver")
    inputs = [args.target, args.drafter, args.weaver, args.prompts]
    out = check_output(args.out, inputs, args.overwrite)  # before loading anything
    device = resolve_device(args.device)
    args.budgets = budgets = args.budgets or default_budgets(device)  # (results.json records what ran)
    dtype = resolve_dtype(args.dtype, device)
    prompts = load_prompt_file(args.prompts) if args.prompts else load_eval_prompts(args.datasets)
    if args.subset:
        prompts = {ds: items[: args.subset] for ds, items in prompts.items()}
    target, tokenizer = load_target(args.target, dtype=dtype, device=device)
    drafter_dtype = resolve_drafter_dtype(args.drafter_dtype, device, dtype)
    drafter = (DFlashDraftModel.from_pretrained(args.drafter, dtype=drafter_dtype).to(device).eval()
               if args.drafter else None)
    weaver = WeaverModel.from_pretrained(args.weaver, dtype=drafter_dtype).to(device).eval() if args.weaver else None
    methods = build_methods(args.modes, budgets, args.temperatures, args.sampling_verifications,
                            args.hf_baseline)
    datasets = list(prompts)
    info = (f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), dtype "
            f"{str(dtype).replace('torch.', '')} (drafters {str(drafter_dtype).replace('torch.', '')}), target "
            f"{args.target}, max_new_tokens {args.max_new_tokens}, "
            f"prompts {', '.join(f'{DATASET_TITLES.get(d, d)} {len(v)}' for d, v in prompts.items())}, "
            f"{time.strftime('%Y-%m-%d')}; AR = our TargetAdapter path, target steps {args.target_step}")

    with written_output(out, inputs, args.overwrite, keep_partial=True) as tmp:
        def save(rows):  # after every method, so an interrupted run keeps what it measured
            table = markdown_table(rows, datasets) + "\n\nPer verify step (ms):\n\n" + phase_table(rows)
            (tmp / "table.md").write_text(table + "\n\n" + info + "\n")
            serial = [{k: v for k, v in r.items() if k != "_runs"} | {
                "per_prompt": [asdict(x) | {"output": None} for x in r["_runs"]]} for r in rows]
            (tmp / "results.json").write_text(json.dumps({"info": info, "args": vars(args), "rows": serial},
                                                         indent=1, default=str))
            return table

        rows = run_benchmark_suite(target, tokenizer, drafter, weaver, prompts, methods, args.max_new_tokens,
                                   args.seed, progress=not args.no_progress, max_minutes=args.max_minutes,
                                   on_method=save, target_step=args.target_step, recalibrate=args.recalibrate)
        print(save(rows))
        print(info)
        if not args.no_plot:
            plot(rows, tmp / "plot.png")
    print(f"results: {out}" + ("" if args.no_plot else f" (plot: {out / 'plot.png'})"))
    bad = [f"{r['dataset']} {r['method']}" for r in rows if r.get("identical", 1.0) < 1.0]
    if bad:
        msg = f"greedy output differs from AR in: {', '.join(bad)} (see mismatched_prompts in results.json)"
        if args.strict:
            raise RuntimeError(msg)
        print(f"WARNING: {msg}")
    return 0


__all__ = [
    "Method",
    "add_benchmark_arguments",
    "autoregressive_generate",
    "build_methods",
    "markdown_table",
    "phase_table",
    "run_benchmark",
    "run_benchmark_suite",
]
