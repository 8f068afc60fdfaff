"""Acceptance replay: the real cost of every speculative step at a large target's shape (docs/DESIGN.md §9, issue 5).

Trained drafters for a 27B target are not at hand, and random ones accept nothing. The replay runs the whole loop —
DFlash draft, tree build (chain / DDTree / Weaver), target verify, commit — on random-weight models of the real
shapes (``hub_configs`` specs: Qwen3.6-27B target, its 5-layer DFlash and Weaver), but each step's acceptance is
taken from a **trace**: the accepted lengths recorded by ``weaver bench`` on a real target (``results.json``, greedy
rows), or a synthetic trace with a chosen mean. The accepted path is the most probable root→node path of the traced
length (shorter when the tree is not that deep: the realised MAL is reported). Figures from here are labelled
"replayed acceptance".

``weaver replay`` prints tokens/s, speed-up over our AR path (same target steps), the per-step breakdown (draft, tree,
verify, accept, commit) and peak GPU memory; it writes ``replay.json`` and ``replay.md``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import time
from pathlib import Path

import torch
from transformers.generation import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from .arguments import add_replay_arguments  # noqa: F401 (the flags: one definition, in lab.arguments)
from ..accept import Acceptance, DeviceAcceptance, path_to_leaf
from .benchmark import autoregressive_generate
from ..decoding.budget import auto_sizes, step_costs
from ..decoding.step_cache import capture_flags, release_static_targets, static_draft
from .data import cli_entry
from ..generate import MODES, PHASES, TARGET_STEPS, DFlashRunner, PhaseTimer, _decode
from ..options import StepOptions, TreePolicy
from ..output_dir import check_output, written_output
from ..tree import Tree


def synthetic_trace(mal: float, max_length: int, num_steps: int = 4096, seed: int = 0) -> list[int]:
    """Accepted lengths (bonus included) ``1 + min(G, max_length - 1)``, ``G`` geometric, whose mean is ``mal``: the
    continuation probability ``q`` solves ``1 + Σ_{k=1}^{m} q^k = mal`` (``m = max_length - 1``; the cap at the block
    would otherwise pull the mean below the requested value)."""
    if not 1.0 <= mal <= max_length:
        raise ValueError(f"a synthetic MAL must lie in [1, {max_length}], got {mal}")
    gen = torch.Generator().manual_seed(seed)
    if mal == 1.0:
        return [1] * num_steps
    m = max_length - 1
    lo, hi = 0.0, 1.0
    for _ in range(60):  # E[1 + min(G, m)] = 1 + Σ q^k grows with q
        q = (lo + hi) / 2
        lo, hi = (q, hi) if 1 + sum(q**k for k in range(1, m + 1)) < mal else (lo, q)
    q = (lo + hi) / 2
    if q >= 1.0 - 1e-12:
        return [max_length] * num_steps
    u = torch.rand(num_steps, generator=gen, dtype=torch.float64)
    extra = (torch.log1p(-u) / math.log(q)).floor()  # P(G >= k) = q^k
    return (1 + extra.clamp(max=m)).long().tolist()


def mixed_trace(mal: float, hard_mal: float, segment: int, max_length: int, num_steps: int = 4096, seed: int = 0,
                top: float = 0.8) -> tuple[list[int], list[float]]:
    """A mixed set: ``(accepted lengths, planted peak probability per step)`` in alternating runs of ``segment``
    steps, easy first — easy steps as :func:`synthetic_trace` of ``mal`` with peaks of ``top``, hard ones of
    ``hard_mal`` with peaks of ``hard_mal - 1``, so the drafter's confidence says what the trace will accept (as a
    trained drafter's does between text it knows and text it does not)."""
    if segment < 1:
        raise ValueError(f"a mixed set's segments hold at least one step, got {segment}")
    if not 1.0 < hard_mal < mal:
        raise ValueError(f"a mixed set's hard MAL must lie in (1, {mal}) (the easy MAL), got {hard_mal}")
    easy = synthetic_trace(mal, max_length, num_steps, seed)
    hard = synthetic_trace(hard_mal, max_length, num_steps, seed + 1)
    is_hard = [(s // segment) % 2 == 1 for s in range(num_steps)]
    trace = [h if flag else e for e, h, flag in zip(easy, hard, is_hard)]
    return trace, [hard_mal - 1.0 if flag else top for flag in is_hard]


def load_traces(results_json: str | Path) -> dict[tuple[str, int], list[int]]:
    """Greedy traces ``{(mode, budget): accepted lengths}`` from a ``weaver bench`` results.json (all prompts)."""
    rows = json.loads(Path(results_json).read_text())["rows"]
    traces: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        # (budget auto changes the tree size per step: it has no fixed-shape replay yet)
        if row["mode"] in MODES and float(row["temperature"]) == 0.0 and row["budget"] != "auto":
            lengths = [n for run in row["per_prompt"] for n in run.get("accepted_lengths", [])]
            if lengths:
                traces.setdefault((row["mode"], int(row["budget"])), []).extend(lengths)
    if not traces:
        raise ValueError(f"{results_json} holds no greedy tree rows with accepted lengths (re-run `weaver bench`)")
    return traces


class ReplayedAcceptance(DeviceAcceptance):
    """Accept, at step s, the most probable root→node path with ``trace[s]`` nodes (bonus: the target's argmax).

    On the device (:meth:`tensors`, which a fused captured step can hold: the trace and the step counter are device
    tensors) or on a :class:`Tree` (``__call__``, same code). :meth:`reset` restarts the trace for a new generation.
    """

    def __init__(self, trace: list[int], device=None, tops: list[float] | None = None):
        if tops is not None and len(tops) != len(trace):
            raise ValueError(f"a mixed set gives one planted peak per traced step: {len(tops)} peaks, "
                             f"{len(trace)} steps")
        self.trace = torch.tensor(trace, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)
        # a mixed set's confidence follows the trace: the planter reads this acceptance's step
        self.planter = _PLANTER if tops is None else PeakPlanter(tops=torch.tensor(tops, device=device),
                                                                 step=self.step)

    def reset(self) -> None:
        self.step.zero_()

    def state(self) -> list[torch.Tensor]:
        """What :meth:`tensors` updates in place (restored around a captured step's warm-up)."""
        return [self.step]

    def tensors(self, tokens, parents, logits, ancestor_mask, logq):
        want = self.trace[(self.step % self.trace.shape[0]).view(1)][0]
        self.step += 1
        depth = ancestor_mask.sum(1) - 1
        real = ancestor_mask[:, 0]  # padding roots never qualify
        path_logq = torch.where(ancestor_mask, logq.float()[None], 0.0).sum(1)  # root→node log-probability
        reach = torch.minimum(want - 1, torch.where(real, depth, 0).max())
        leaf = torch.where(real & (depth == reach), path_logq, float("-inf")).argmax().view(1)
        return path_to_leaf(ancestor_mask, leaf, depth), depth[leaf][0] + 1, logits[leaf][0].argmax()

    def __call__(self, tree: Tree, scores: torch.Tensor) -> Acceptance:
        logq = tree.logq.clone()
        logq[0] = 0.0
        path, length, bonus = self.tensors(tree.tokens, tree.parents, scores, tree.ancestor_mask, logq)
        *path, length, bonus = torch.cat([path, length.view(1), bonus.view(1)]).tolist()  # the one host read
        return Acceptance(path[:length], bonus)


class PeakPlanter:
    """Plants one token per depth d of the draft marginals with probability ``top · decay**d`` (device ops only).

    Random drafters give near-uniform marginals, so best-first trees come out as stars and cannot hold the traced
    depths; trained drafters are peaked. Planting a peak gives the trees the depth a trained drafter gives them, at
    the drafter's real cost (one extra logsumexp per depth). Peaks come from the device's default random stream, so
    a captured step can hold the planting. ``tops`` and ``step`` (device tensors): ``top`` per step instead, read at
    the step counter (a mixed set, :func:`mixed_trace`).
    """

    def __init__(self, top: float = 0.8, decay: float = 0.95, tops: torch.Tensor | None = None,
                 step: torch.Tensor | None = None):
        if (tops is None) != (step is None):
            raise ValueError("per-step tops need the step counter that indexes them, and the reverse")
        self.top, self.decay, self.tops, self.step = top, decay, tops, step

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        depth, vocab = logits.shape
        rows = torch.arange(depth, device=logits.device)
        peak = torch.randint(vocab, (depth,), device=logits.device)
        top = self.top if self.tops is None else self.tops[(self.step % self.tops.shape[0]).view(1)].double()
        q = top * self.decay ** rows.double()
        others = logits.float().scatter(1, peak[:, None], float("-inf")).logsumexp(-1)
        planted = (torch.log(q / (1 - q)) + others.double()).to(logits.dtype)
        return logits.index_put((rows, peak), planted)


class PlantedRunner:
    """An eager drafting runner with planted peaks (:class:`PeakPlanter`)."""

    def __init__(self, runner, planter: PeakPlanter):
        self.runner, self.planter = runner, planter
        self.feature_layer_ids, self.block_size = runner.feature_layer_ids, runner.block_size

    def draft(self, bonus, context, n, depths=None):
        hidden, logits = self.runner.draft(bonus, context, n, depths)
        return hidden, self.planter(logits)


_PLANTER = PeakPlanter()  # one instance: captured proposers are kept per planter


def replay_generate(target, drafter, weaver, input_ids: torch.Tensor, mode: str, tree_budget: int | str,
                    acceptance: ReplayedAcceptance, max_new_tokens: int, target_step: str = "graph",
                    fused: bool = True, streamer=None, tree_policy: TreePolicy = TreePolicy(),
                    step_options: StepOptions = StepOptions()):
    """One generation with replayed acceptance (restarted from the trace's first step); returns ``(ids,
    SpeculativeStats with phase_ms)``. Keep one ``acceptance`` per method: captured steps are kept per object.
    ``streamer`` receives the new tokens (not the prompt) as they reach the host.

    ``fused=False`` keeps acceptance on the host, so static/graph steps stay split into draft+tree, verify and commit
    (a per-phase breakdown) instead of one fused step per iteration. ``tree_budget="auto"``: each step's size chosen
    (split steps) from the step costs of this shape, measured with the plain drafter on first use and cached as a
    generation's are, and the planted trees' scores corrected by the replayed acceptance."""
    acceptance.reset()
    policy = None
    if tree_budget == "auto":
        tree_budget, policy, sizes = auto_sizes("auto", None, target, input_ids.device)
        costs = step_costs(target, DFlashRunner(drafter, target, step_options), weaver, mode, sizes, tree_policy,
                           step_options, policy, target_step)
        policy = dataclasses.replace(policy, costs=costs)
    stopping = StoppingCriteriaList([MaxLengthCriteria(input_ids.shape[1] + max_new_tokens)])
    planter = acceptance.planter
    if target_step == "eager":
        runner = PlantedRunner(DFlashRunner(drafter, target, step_options), planter)
    else:  # draft, planting and tree build in one fixed-shape (captured) step
        flags = capture_flags(target_step, input_ids.device)
        draft = static_draft(drafter, target, input_ids.shape[1] + max_new_tokens + tree_budget + 2, flags["capture"],
                             options=step_options)
        runner = draft.proposer(mode, tree_budget, weaver if mode == "weaver" else None, shape_logits=planter,
                                compile=flags["compile"], policy=tree_policy)
    return _decode(
        target, input_ids[0], runner=runner, weaver=weaver, mode=mode,
        tree_budget="auto" if policy else tree_budget,
        max_new_tokens=max_new_tokens, processors=LogitsProcessorList(), do_sample=False, verification=None,
        stopping_criteria=stopping, streamer=streamer, generator=None, target_step=target_step,
        timer=PhaseTimer(input_ids.device), accept=acceptance if fused else acceptance.__call__,
        tree_policy=tree_policy, step_options=step_options, budget_policy=policy,
    )


#: config fields :func:`shrunk_configs` divides (widths; head counts, top-k and block size are kept)
_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim",
           "linear_key_head_dim", "linear_value_head_dim", "vocab_size", "d_model", "d_embed", "d_rank", "mlp_dim",
           "candidate_pool_size")
_EXPERT_COUNTS = ("num_experts", "num_local_experts")


def shrunk_configs(target_config, dflash_config, weaver_config, scale: int = 1, layers: int | None = None):
    """Copies of a shape's three configs made smaller for smoke runs (CPU), the structure kept: every width in
    ``_WIDTHS`` (hidden, head dims, FFN / expert / shared-expert widths, vocabulary, Weaver ranks and pool) divided
    by ``scale`` (in all three alike, so they still pair), the expert count too (never below the routed top-k);
    ``layers``: the target's first ``layers`` layers, which must still hold every layer kind (``layer_types``) of
    the full shape, the drafter's feature layers spread over them. Head counts, top-k, the drafter's depth and
    block size stay. ``scale=1, layers=None``: the configs themselves."""
    if scale < 1:
        raise ValueError(f"shape scale must be a positive integer, got {scale}")
    if scale == 1 and layers is None:
        return target_config, dflash_config, weaver_config
    from ..configuration_dflash import dflash_target_layer_ids
    from ..pairing import check_pair

    t, d, w = (copy.deepcopy(c) for c in (target_config, dflash_config, weaver_config))
    text = t.get_text_config() if hasattr(t, "get_text_config") else t
    if hasattr(text, "linear_attn_config") or getattr(text, "kv_lora_rank", None):
        raise ValueError(f"shrinking {type(text).__name__} is not supported (latent attention and its KDA widths are "
                         "not among the widths divided)")
    vocab = text.vocab_size
    for config in (text, d, w):
        for name in _WIDTHS:
            value = getattr(config, name, None)
            derived = isinstance(getattr(type(config), name, None), property)  # (Weaver's head_dim)
            if isinstance(value, int) and not isinstance(value, bool) and not derived:
                setattr(config, name, max(2, value // scale))
        for name in _EXPERT_COUNTS:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 1:
                setattr(config, name, max(getattr(config, "num_experts_per_tok", 1) or 1, value // scale))
    if layers is not None and layers != text.num_hidden_layers:
        kinds = list(getattr(text, "layer_types", None) or [])
        if not 1 <= layers <= text.num_hidden_layers:
            raise ValueError(f"shape layers must lie in [1, {text.num_hidden_layers}], got {layers}")
        if kinds and set(kinds[:layers]) != set(kinds):
            raise ValueError(f"the first {layers} layers hold {sorted(set(kinds[:layers]))}, not every layer kind of "
                             f"the shape ({sorted(set(kinds))}): give more layers")
        if kinds:
            text.layer_types = kinds[:layers]
        if getattr(text, "mlp_only_layers", None):
            text.mlp_only_layers = [i for i in text.mlp_only_layers if i < layers]
        text.num_hidden_layers = layers
        d.num_target_layers = layers
        features = len(d.target_layer_ids)
        d.target_layer_ids = (dflash_target_layer_ids(layers, min(features, layers)) if layers > features + 2
                              else list(range(layers))[-min(features, layers):])
    if d.mask_token_id is not None and d.mask_token_id >= d.vocab_size:  # as far from the end as in the full vocab
        d.mask_token_id = max(0, d.vocab_size - (vocab - d.mask_token_id))
    check_pair(t, d, w)
    return t, d, w


def random_models(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0, scale: int = 1,
                  layers: int | None = None):
    """Random-weight target, DFlash and Weaver of a ``hub_configs`` shape (or ``tiny``), built on ``device`` in
    ``dtype`` (parameters allocated and initialised there: no host copy). ``scale``, ``layers``: a smaller
    variant of the shape for smoke runs (:func:`shrunk_configs`)."""
    from ..modeling_dflash import DFlashDraftModel
    from ..modeling_weaver import WeaverModel

    torch.manual_seed(seed)
    if shape == "tiny":
        if scale != 1 or layers is not None:
            raise ValueError("the tiny shape cannot be shrunk further")
        from ..cli import _tiny_setup

        target, drafter, weaver, _, _ = _tiny_setup(seed)
        return tuple(m.to(device=device, dtype=dtype).eval() for m in (target, drafter, weaver))
    from transformers import AutoModelForCausalLM

    from ..export import HUB_SPECS

    if shape not in HUB_SPECS:
        raise ValueError(f"unknown shape {shape!r}: choose tiny or one of {sorted(HUB_SPECS)}")
    spec = HUB_SPECS[shape]
    target_config = spec.target()
    dconfig = spec.dflash(target_config)
    wconfig = spec.weaver(target_config, dconfig)
    target_config, dconfig, wconfig = shrunk_configs(target_config, dconfig, wconfig, scale, layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the final dtype: a 27B target would not fit twice
    try:
        with torch.device(device):
            target = AutoModelForCausalLM.from_config(target_config, dtype=dtype)
            drafter, weaver = DFlashDraftModel(dconfig), WeaverModel(wconfig)
    finally:
        torch.set_default_dtype(previous)
    return tuple(m.eval() for m in (target, drafter, weaver))


def spread_map(target, devices: list) -> dict:
    """A ``device_map`` that spreads ``target``'s decoder layers evenly over ``devices`` in order: everything before
    the layers (embedding, rotary, any vision tower) on the first, the final norm and lm_head on the last."""
    decoder = target.model
    decoder = getattr(decoder, "language_model", decoder)  # (Qwen3.5's text model inside its multimodal wrapper)
    names = {module: name for name, module in target.named_modules()}
    placement, node, path = {}, target, names[decoder].split(".")
    for depth in range(len(path)):  # the decoder's ancestors: their other children go first (lm_head last)
        for child_name, child in node.named_children():
            if child_name != path[depth]:
                placement[names[child]] = devices[-1] if child is target.get_output_embeddings() else devices[0]
        node = getattr(node, path[depth])
    count = len(decoder.layers)
    for child_name, child in decoder.named_children():
        if child_name == "layers":
            placement.update({f"{names[child]}.{i}": devices[i * len(devices) // count] for i in range(count)})
        else:
            placement[names[child]] = devices[-1] if child_name == "norm" else devices[0]
    return placement


def spread_over(target, drafter, weaver, devices: list) -> None:
    """``target`` dispatched by accelerate over ``devices`` (:func:`spread_map`; one device: moved there whole),
    the drafter and Weaver beside its lm_head."""
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_submodules

    remove_hook_from_submodules(target)
    if len(devices) == 1:
        target.to(devices[0])
    else:
        dispatch_model(target, spread_map(target, devices))
    for model in (drafter, weaver):
        model.to(devices[-1])


def set_experts_implementation(model: torch.nn.Module, implementation: str) -> int:
    """Run ``model``'s MoE experts through transformers' ``implementation`` (``grouped_mm``, ``batched_mm``,
    ``eager``): set on the configs its experts modules read at every call (as
    :func:`~modeling_weaver.target.capturable_experts` does); returns how many configs were set (0: no MoE)."""
    configs = {id(c): c for m in model.modules()
               if hasattr(type(m), "_apply_gate") and (c := getattr(m, "config", None)) is not None}
    for config in configs.values():
        config._experts_implementation = implementation
    return len(configs)


@contextlib.contextmanager
def fresh_steps(*models):
    """Inside the block, steps of ``models`` are built anew: their cached steps are dropped on entry and on exit, also
    when the block raises (the steps of an A/B run's two settings would otherwise both hold their caches)."""
    for model in models:
        release_static_targets(model)
    try:
        yield
    finally:
        for model in models:
            release_static_targets(model)


@contextlib.contextmanager
def int8_drafter(drafter, target):
    """The drafter's linears on int8 weights (:func:`~modeling_weaver.packed.int8_linears`) inside the block, on steps
    built anew (the drafter's and ``target``'s cached steps are dropped on entry and on exit)."""
    from ..packed import int8_linears, remove_int8_linears

    int8_linears(drafter)  # (which drops the drafter's steps)
    release_static_targets(target)
    try:
        yield
    finally:
        remove_int8_linears(drafter)
        release_static_targets(target)


def ab_switches() -> dict:
    """The settings the A/B scripts flip, by name: ``(which, field, off, on)`` for a field of the
    :class:`~modeling_weaver.options.TreePolicy` (``which="policy"``) or
    :class:`~modeling_weaver.options.StepOptions` (``"options"``), where None ("on where it applies") counts as on,
    or None for ``int8_drafter`` (:func:`int8_drafter`)."""
    return {"node_table": ("options", "node_table", False, True),
            "peel_root": ("options", "peel_root", False, True),
            "gates_in_kernel": ("options", "gates_in_kernel", False, True),
            "node_attention": ("policy", "fused_node_attention", False, True),
            "neumann": ("options", "neumann", False, True),
            "spine": ("policy", "spine", False, True),
            "int8_head": ("options", "int8_head", False, True), "int8_drafter": None,
            "fan64": ("policy", "children_per_node", 8, 64), "root_leaves": ("policy", "root_children", 0, None)}


def ab_setting(name: str, on: bool | None, drafter, target, policy: TreePolicy = TreePolicy(),
               options: StepOptions = StepOptions()):
    """``(context manager, label)``: the A/B setting ``name`` (:func:`ab_switches`) off or on, on steps built anew
    inside the block; the block gets ``(policy, options)`` with that setting (``dataclasses.replace`` of the ones
    given); ``on=None`` flips it from where it stands in them."""
    switch = ab_switches()[name]
    if switch is None:  # int8_linears is never applied by default
        on = True if on is None else on
        setting = int8_drafter(drafter, target) if on else contextlib.nullcontext()
        return _yielding(setting, (policy, options)), f"{name}={on}"
    which, field, off, on_value = switch
    current = policy if which == "policy" else options
    if on is None:
        on = getattr(current, field) not in (on_value, None)
    value = on_value if on else off
    changed = dataclasses.replace(current, **{field: value})
    settings = (changed, options) if which == "policy" else (policy, changed)
    return _yielding(fresh_steps(drafter, target), settings), f"{field}={value}"


@contextlib.contextmanager
def _yielding(context, value):
    with context:
        yield value


@contextlib.contextmanager
def gc_pauses():
    """Durations (s) of the garbage collector's runs inside the block (a list, filled as they happen)."""
    pauses, started = [], []

    def track(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(track)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(track)


class FirstTokenClock:
    """A streamer that notes when each new token reaches the host (``times``); the first one's (``first_token``)
    says when the prefill (and the first token) is done, in the very run whose decode rate it separates out.
    ``prompt_puts``: puts before it (a prompt)."""

    def __init__(self, prompt_puts: int = 0):
        self.prompt_puts, self.puts, self.times = prompt_puts, 0, []

    @property
    def first_token(self) -> float | None:
        return self.times[0] if self.times else None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > self.prompt_puts:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def random_prompt(target, length: int, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` random token ids on the device of the target's input embedding (the same for every method of
    a run)."""
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(target.get_input_embeddings().weight.device)


def memory_check(target, drafter, weaver, trace: list[int], mode: str, budget: int, prompt_len: int, tokens: int,
                 target_step: str, seed: int = 0) -> dict:
    """Two ``tokens``-long replayed generations of one method (CUDA): allocated memory before and after the second
    (the first captures and compiles; the second reuses its buffers and graphs, so any per-step growth shows) and
    the peak over both."""
    device = next(target.parameters()).device
    ids = random_prompt(target, prompt_len, seed)
    acceptance = ReplayedAcceptance(trace, device)
    torch.cuda.reset_peak_memory_stats(device)
    replay_generate(target, drafter, weaver, ids, mode, budget, acceptance, tokens, target_step)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out, _ = replay_generate(target, drafter, weaver, ids, mode, budget, acceptance, tokens, target_step)
    torch.cuda.synchronize(device)
    return {"method": f"{mode}@{budget}", "new_tokens": out.shape[1] - ids.shape[1],
            "allocated_gib": before / 2**30, "growth_mib": (torch.cuda.memory_allocated(device) - before) / 2**20,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def run_replay_suite(target, drafter, weaver, traces: dict, modes, budgets, prompt_len: int, max_new_tokens: int,
                     target_step: str, seed: int = 0, hf_tokens: int = 0, fused: bool = True,
                     split: bool = False, on_row=None, tree_policy: TreePolicy = TreePolicy(),
                     step_options: StepOptions = StepOptions(), tops: dict | None = None) -> list[dict]:
    """AR (and HF eager for ``hf_tokens``), then every budget × mode with its trace; one row each: decode tokens/s
    (prefill excluded), speed-up over AR, MAL, ms per step and per phase. ``split`` adds, per method, a run with
    unfused steps ("split": per-phase times). ``on_row(rows)`` is called after every row (save as you go).
    ``tree_policy``, ``step_options``: the settings every method runs with (AR: the step options). ``tops``: per
    method, the planted peak per step of a mixed set (:func:`mixed_trace`)."""
    on_row = on_row or (lambda rows: None)
    device = target.get_input_embeddings().weight.device  # (the loop's home, where acceptance runs)
    ids = random_prompt(target, prompt_len, seed)
    used = {p.device for p in target.parameters()} | {p.device for p in drafter.parameters()}

    def sync():  # every GPU the run uses (a target spread over several: the last layers finish last)
        for d in used:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def timed(fn, prompt_puts: int = 0):
        """``fn(warm, streamer)`` after a warm-up call; ``(its output, decode seconds, prefill seconds)``, both from
        one run: decode = from the first new token on the host to the end (the same prefill precedes every method,
        and subtracting one measured in another run would add its noise to the decode rate)."""
        fn(warm=True, streamer=None)  # warm-up: compilation, graph capture (same lengths: same buckets and graphs)
        sync()
        # compiling and capturing leave a large heap: collect it once, and keep the collector off it while timing
        gc.collect()
        gc.freeze()
        clock = FirstTokenClock(prompt_puts)
        try:
            with gc_pauses() as pauses:
                start = time.perf_counter()
                out = fn(warm=False, streamer=clock)
                sync()
                end = time.perf_counter()
        finally:
            gc.unfreeze()
        timed.gc_ms = 1e3 * sum(pauses)
        return out, end - clock.first_token, clock.first_token - start

    _, seconds, prefill = timed(lambda warm, streamer: autoregressive_generate(
        target, ids, max_new_tokens, eos_token_id=[], target_step=target_step, streamer=streamer,
        step_options=step_options), prompt_puts=1)
    ar_tps = (max_new_tokens - 1) / seconds
    rows = [{"method": "ar", "tokens_per_s": ar_tps, "ms_per_step": 1e3 / ar_tps, "mal": 1.0, "speedup": 1.0,
             "prefill_s": prefill, "gc_ms": timed.gc_ms}]
    on_row(rows)
    if hf_tokens:
        def hf(warm, streamer):
            return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, streamer=streamer,
                                   max_new_tokens=2 if warm else hf_tokens, min_new_tokens=2 if warm else hf_tokens)
        _, seconds, _ = timed(hf, prompt_puts=1)
        hf_tps = (hf_tokens - 1) / seconds
        rows.append({"method": "hf eager", "tokens_per_s": hf_tps, "ms_per_step": 1e3 / hf_tps, "mal": 1.0,
                     "speedup": hf_tps / ar_tps})
        on_row(rows)
    for budget in budgets:
        for mode in modes:
            trace = traces[(mode, budget)]
            acceptance = ReplayedAcceptance(trace, device, (tops or {}).get((mode, budget)))
            for fuse in (fused, False) if split else (fused,):
                (out, stats), seconds, _ = timed(
                    lambda warm, streamer, mode=mode, budget=budget, acc=acceptance, fuse=fuse: replay_generate(
                        target, drafter, weaver, ids, mode, budget, acc, max_new_tokens, target_step, fuse, streamer,
                        tree_policy, step_options))
                steps = stats.num_steps
                tps = (out.shape[1] - ids.shape[1] - 1) / seconds
                rows.append({
                    "method": f"{mode}@{budget}" + ("" if fuse == fused else " split"), "mode": mode,
                    "budget": budget, "tokens_per_s": tps, "speedup": tps / ar_tps, "mal": stats.mean_accepted_length,
                    "trace_mal": sum(trace) / len(trace), "ms_per_step": 1e3 * seconds / steps,
                    "gc_ms": timed.gc_ms,
                    **{f"{p}_ms": stats.phase_ms[p] / steps for p in PHASES if p in stats.phase_ms},
                    **({"sizes": {str(k): v for k, v in stats.size_histogram.items()},
                        "calibration": stats.calibration} if budget == "auto" else {}),
                })
                on_row(rows)
    return rows


def token_weight_bytes(target) -> tuple[int, int]:
    """``(all, read)``: the target's weight bytes, and those one AR token reads. A MoE block's routed experts (a
    module named ``experts`` holding every expert's weights stacked) count ``top_k / num_experts`` of their bytes."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    total = read = 0
    for name, p in target.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        routed = experts and top_k and ".experts." in f".{name}" and p.dim() >= 3 and p.shape[0] == experts
        read += nbytes * top_k // experts if routed else nbytes
    return total, read


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Measured device copy bandwidth in bytes/s (read + write counted), median of ``reps`` CUDA-event timings."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / sorted(times[3:])[reps // 2]


def graph_replay_ms(graph, reps: int = 10) -> tuple[float, float]:
    """``(GPU ms per replay, median host ms per replay() call)`` of a captured CUDA graph replayed ``reps`` times
    back to back (what the graph costs with no host work between replays; replays advance whatever it updates)."""
    torch.cuda.synchronize()
    host = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        t0 = time.perf_counter()
        graph.replay()
        host.append(1e3 * (time.perf_counter() - t0))
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps, sorted(host)[reps // 2]


def replay_table(rows: list[dict]) -> str:
    head = ["method", "MAL (trace)", "decode tok/s", "×AR", "ms/step"] + [f"{p} ms" for p in PHASES] + ["GC ms/run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mal = f"{r['mal']:.2f} ({r['trace_mal']:.2f})" if "trace_mal" in r else "1.00"
        phases = [f"{r[p + '_ms']:.2f}" if p + "_ms" in r else "–" for p in PHASES]
        gc_ms = f"{r['gc_ms']:.0f}" if "gc_ms" in r else "–"
        lines.append("| " + " | ".join([r["method"], mal, f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
                                        f"{r['ms_per_step']:.2f}"] + phases + [gc_ms]) + " |")
    sizes = [f"{r['method']}: " + ", ".join(f"{k}: {v}" for k, v in r["sizes"].items()) for r in rows if "sizes" in r]
    return "\n".join(lines + (["", "Steps per draft count (0: AR steps) — " + "; ".join(sizes)] if sizes else []))


def _parse_mal(items: list[str], modes, budgets) -> dict:
    """``mode=MAL`` (every budget) or ``mode@budget=MAL`` (``budget``: draft nodes or ``auto``)."""
    mals = {}
    for item in items:
        key, _, value = item.partition("=")
        mode, _, budget = key.partition("@")
        if mode not in MODES or not value:
            raise ValueError(f"--synthetic-mal entries are mode=MAL or mode@budget=MAL, got {item!r}")
        for b in ([budget if budget == "auto" else int(budget)] if budget else budgets):
            mals[(mode, b)] = float(value)
    missing = [f"{m}@{b}" for m in modes for b in budgets if (m, b) not in mals]
    if missing:
        raise ValueError(f"--synthetic-mal gives no MAL for {', '.join(missing)}")
    return mals


def _shrunk(args) -> str:
    """How the run's shape was shrunk (``--shape-scale``, ``--shape-layers``), for its info line."""
    parts = ([f"widths / {args.shape_scale}"] if args.shape_scale != 1 else []) + (
        [f"first {args.shape_layers} layers"] if args.shape_layers else [])
    return f" (shrunk: {', '.join(parts)})" if parts else ""


@cli_entry
def run_replay(args) -> int:
    out = check_output(args.out, [args.trace], args.overwrite)  # before building any model
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.devices != [1]:  # (checked before building: a 27B target takes a while)
        if device.type != "cuda" or max(args.devices) > torch.cuda.device_count():
            raise ValueError(f"--devices {' '.join(map(str, args.devices))} spreads the target over that many GPUs; "
                             f"this machine has {torch.cuda.device_count() if device.type == 'cuda' else 0}")
        if args.target_step != "eager":
            raise ValueError("--devices spreads the target with device_map, whose steps run eager: pass "
                             "--target-step eager (CUDA graphs capture one device)")
        device = torch.device("cuda", 0)
    target, drafter, weaver = random_models(args.shape, device, getattr(torch, args.dtype), args.seed,
                                            args.shape_scale, args.shape_layers)
    if args.experts_implementation:
        set_experts_implementation(target, args.experts_implementation)
    if args.int8_drafter:
        from ..packed import int8_linears

        int8_linears(drafter)
    tops = None
    if args.trace:
        if args.mixed:
            raise ValueError("--mixed builds synthetic traces: give --synthetic-mal, not --trace")
        traces, source = load_traces(args.trace), f"trace {args.trace}"
        for mode in args.modes if "auto" in args.budgets else ():  # auto replays the mode's largest tree's trace
            fixed = [b for m, b in traces if m == mode]
            if fixed:
                traces[(mode, "auto")] = traces[(mode, max(fixed))]
        missing = [f"{m}@{b}" for m in args.modes for b in args.budgets if (m, b) not in traces]
        if missing:
            raise ValueError(f"{args.trace} has no greedy trace for {', '.join(missing)}; it has "
                             f"{', '.join(f'{m}@{b}' for m, b in sorted(traces, key=str))}")
    else:
        mals = _parse_mal(args.synthetic_mal, args.modes, args.budgets)
        source = "synthetic traces (" + ", ".join(f"{m}@{b}={v:g}" for (m, b), v in sorted(mals.items(), key=str)) + ")"
        if args.mixed:
            hard_mal, segment = args.mixed
            if segment != int(segment):
                raise ValueError(f"--mixed takes a whole number of steps per run, got {segment:g}")
            made = {k: mixed_trace(v, hard_mal, int(segment), drafter.block_size, seed=args.seed)
                    for k, v in mals.items()}
            traces, tops = {k: t for k, (t, _) in made.items()}, {k: p for k, (_, p) in made.items()}
            source = (f"a mixed set: runs of {int(segment)} steps alternating the {source} with hard steps of MAL "
                      f"{hard_mal:g}, the planted peaks following them")
        else:
            traces = {k: synthetic_trace(v, drafter.block_size, seed=args.seed) for k, v in mals.items()}
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    weight_bytes, read_bytes = token_weight_bytes(target)
    limit = ""
    if device.type == "cuda":  # memory-bound AR limit: every weight a token uses read once per token
        bandwidth = copy_bandwidth(device)
        routed = "" if read_bytes == weight_bytes else f", {read_bytes / 1e9:.1f} GB of them a token's (routed experts)"
        limit = (f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s, target weights {weight_bytes / 1e9:.1f} GB{routed} → "
                 f"memory-bound AR limit {bandwidth / read_bytes:.1f} tok/s")
        torch.cuda.reset_peak_memory_stats(device)

    with written_output(out, [args.trace], args.overwrite, keep_partial=True) as tmp:
        def save(rows, final=False):
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            info = (f"replayed acceptance — {source}; shape {args.shape}{_shrunk(args)}, {args.dtype}, random "
                    f"weights; prompt {args.prompt_length}, {args.max_new_tokens} new tokens, batch 1; steps "
                    f"{args.target_step}{' unfused' if args.no_fuse else ''}"
                    f"{'; int8 drafter linears' if args.int8_drafter else ''}"
                    + (f"; experts {args.experts_implementation}" if args.experts_implementation else "")
                    + f"; device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
                    + (f"; peak memory {peak:.1f} GiB" if peak is not None else "") + limit
                    + f"; decode rates (prefill excluded); {time.strftime('%Y-%m-%d')}"
                    + ("" if final else "; INCOMPLETE (run still going or stopped)"))
            table = replay_table(rows)
            if not final:
                print(table.splitlines()[-1], flush=True)
            (tmp / "replay.md").write_text(table + "\n\n" + info + "\n")
            (tmp / "replay.json").write_text(json.dumps({"info": info, "args": settings, "rows": rows}, indent=1))
            return table, info

        rows = []
        for count in args.devices:  # (one pass of the suite per count, the rows of all of them in one table)
            if args.devices != [1]:
                spread_over(target, drafter, weaver, [torch.device("cuda", i) for i in range(count)])
            done = list(rows)
            label = f" ({count} GPU{'s' if count > 1 else ''})" if args.devices != [1] else ""

            def on_row(part, done=done, label=label):
                rows[:] = done + [{**r, "method": r["method"] + label, "devices": count} for r in part]
                save(rows)

            run_replay_suite(target, drafter, weaver, traces, args.modes, args.budgets, args.prompt_length,
                             args.max_new_tokens, args.target_step, args.seed, args.hf_tokens, not args.no_fuse,
                             args.split, on_row=on_row, tops=tops)
        table, info = save(rows, final=True)
        print(table)
        print(info)
        if args.memory_tokens and device.type == "cuda":
            mode, budget = args.modes[0], args.budgets[-1]
            check = memory_check(target, drafter, weaver, traces[(mode, budget)], mode, budget, args.prompt_length,
                                 args.memory_tokens, args.target_step, args.seed)
            (tmp / "memory.json").write_text(json.dumps(check, indent=1))
            print(f"memory over a second {check['new_tokens']}-token {check['method']} generation: "
                  f"{check['allocated_gib']:.2f} GiB allocated before, growth {check['growth_mib']:+.2f} MiB, "
                  f"peak {check['peak_gib']:.2f} GiB")
    return 0


__all__ = ["ReplayedAcceptance", "graph_replay_ms", "load_traces", "memory_check", "random_models", "random_prompt",
           "fresh_steps", "mixed_trace", "replay_generate", "run_replay", "set_experts_implementation",
           "shrunk_configs", "spread_map", "spread_over", "synthetic_trace"]
