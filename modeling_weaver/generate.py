"""Tree speculative decoding, the public entry points (docs/DESIGN.md §1), batch 1.

``speculative_generate`` is the plain-function API; ``generate`` is the same loop behind
``target.generate(input_ids, custom_generate=generate, drafter=..., weaver=...)``. Both check what they are given
(:mod:`.validation`) and run :func:`~.decoding.loop._decode`; the names below them are re-exported for callers of
this module (``modeling_weaver.generate.REFUSED`` is the documented path).
"""

from __future__ import annotations

import sys
import warnings

import torch
from transformers.generation import GenerateDecoderOnlyOutput, LogitsProcessorList, StoppingCriteriaList

from .decoding.drafting import DFlashRunner
from .decoding.loop import PHASES, TARGET_STEPS, PhaseTimer, SpeculativeStats, _decode
from .options import BudgetPolicy, StepOptions, TreePolicy
from .packed import generation_packing
from .tree import default_tree_budget, default_tree_mode
from .validation import (LENGTH_PROCESSORS, MODES, REFUSED, ROW_WISE_PROCESSORS, VERIFICATIONS, check_call,
                         check_processors, check_room, check_settings, prepare_settings, refuse)


def speculative_generate(
    target,
    input_ids: torch.Tensor,
    *,
    drafter,
    weaver=None,
    mode: str | None = None,
    tree_budget: int | str | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    streamer=None,
    return_stats: bool = False,
    verification: str | None = None,
    generator: torch.Generator | None = None,
    target_step: str = "eager",
    timer: PhaseTimer | None = None,
    generation_config=None,
    tree_policy: TreePolicy | None = None,
    step_options: StepOptions | None = None,
    budget_policy: BudgetPolicy | None = None,
    **generation_kwargs,
):
    """Lossless tree speculative decoding of ``target`` with a DFlash ``drafter`` (and optionally a Weaver).

    Greedy output is token-identical to ``target.generate(input_ids, do_sample=False)`` with the same generation
    config; sampled output follows the target's (temperature / top-k / top-p processed) distribution exactly.

    Args:
        target: a supported causal LM (see :mod:`modeling_weaver.target`).
        input_ids: ``[1, T]`` prompt (batch 1), on the target's device.
        drafter: :class:`~modeling_weaver.modeling_dflash.DFlashDraftModel` trained for this target.
        weaver: :class:`~modeling_weaver.modeling_weaver.WeaverModel`; required for ``mode="weaver"``.
        mode: ``"weaver"`` (Weaver best-first tree), ``"ddtree"`` (best-first over DFlash marginals) or
            ``"chain"`` (plain DFlash); default :func:`~modeling_weaver.tree.default_tree_mode`: ``"weaver"`` on
            accelerators when ``weaver`` is given, else ``"ddtree"`` (on a CPU a Weaver build costs more than it
            brings; ``stats.mode`` says which ran). Every mode gives the same tokens.
        tree_budget: draft nodes per tree (the root/bonus token is extra), at most
            :func:`~modeling_weaver.tree.max_tree_budget`; default :func:`~modeling_weaver.tree.default_tree_budget`
            (5 on CPU, 64 elsewhere); or ``"auto"``: each step verifies the size that maximises expected tokens per
            second, AR steps included, from step costs measured once and cached and the drafter's confidence
            (docs/DESIGN.md §12; ``stats.size_histogram``, ``stats.calibration``).
        max_new_tokens: default: ``generation_config``'s ``max_new_tokens`` or ``max_length``, else 128.
        do_sample, temperature, top_k, top_p: this function's own (greedy unless ``do_sample``; they override
            ``generation_config``'s); the values are checked as transformers' warpers check them.
        eos_token_id: one id or several; defaults to the target's generation config.
        streamer: a transformers streamer (``put``/``end``); receives the prompt, then tokens as they are committed.
        verification: when sampling, ``"target_only"`` (any tree) or ``"traversal"`` (default for Weaver trees).
        generator: random source for sampling.
        target_step: ``"eager"`` (each tree at its own size), ``"static"`` (every tree padded to ``tree_budget + 1``
            nodes, attention over the whole cache, fixed-length commits: the shapes of a captured step) or
            ``"graph"`` (static, and each verify/commit replayed as a CUDA graph on CUDA) or ``"compiled"`` (graph,
            with the target's tree pass and the tree build ``torch.compile``d once per tree size). Same tokens.
        timer: a :class:`PhaseTimer`: the time of each loop phase lands in ``stats.phase_ms``.
        tree_policy: how Weaver trees are built (:class:`~modeling_weaver.options.TreePolicy`; default: its defaults).
        step_options: how the step's kernels run (:class:`~modeling_weaver.options.StepOptions`); no option changes
            the tokens.
        budget_policy: how ``tree_budget="auto"`` chooses (:class:`~modeling_weaver.options.BudgetPolicy`: candidate
            sizes, calibration cache, a given cost table; default: its defaults).
        generation_config, generation_kwargs: as ``target.generate`` takes them (default: the target's
            ``generation_config``), prepared as it prepares them; lengths (``min_new_tokens``, ``min_length``, ...)
            and processors that act per distribution or per length are applied, the settings of :data:`REFUSED`
            raise a ``ValueError`` naming them.

    Returns:
        ``[1, T + new]`` token ids, and a :class:`SpeculativeStats` when ``return_stats=True``.
    """
    tree_budget = _budget_or_default(tree_budget, input_ids)
    mode = _mode_or_default(mode, weaver, input_ids)
    check_call(target, input_ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=tree_budget,
               verification=verification, do_sample=do_sample, temperature=temperature, eos_token_id=eos_token_id,
               attention_mask=generation_kwargs.pop("attention_mask", None), max_new_tokens=max_new_tokens)
    settings = dict(generation_kwargs, do_sample=do_sample)
    if do_sample:  # (greedy: transformers ignores them, and so do we once they are checked)
        settings.update(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    else:
        settings.update({k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None})
    if eos_token_id is not None:
        settings["eos_token_id"] = eos_token_id
    config, processors, stopping = prepare_settings(target, input_ids, generation_config, max_new_tokens, settings)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    ids, stats = _run(
        target, input_ids, drafter=drafter, weaver=weaver, step_options=step_options, target_step=target_step,
        mode=mode, tree_budget=tree_budget, max_new_tokens=config.max_length - input_ids.shape[1],
        processors=processors, do_sample=do_sample, verification=verification, stopping_criteria=stopping,
        streamer=streamer, generator=generator, timer=timer, tree_policy=tree_policy or TreePolicy(),
        budget_policy=budget_policy,
    )
    return (ids, stats) if return_stats else ids


def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    drafter=None,
    weaver=None,
    mode: str | None = None,
    tree_budget: int | str | None = None,
    verification: str | None = None,
    tree_streamer=None,
    target_step: str = "eager",
    tree_policy: TreePolicy | None = None,
    step_options: StepOptions | None = None,
    budget_policy: BudgetPolicy | None = None,
    **model_kwargs,
):
    """``target.generate(input_ids, custom_generate=generate, drafter=..., weaver=..., mode=..., tree_budget=...)``.

    ``mode`` (default: the device's), ``tree_budget`` (``"auto"`` too), ``target_step``, ``tree_policy``,
    ``step_options``, ``budget_policy`` as in :func:`speculative_generate` (``"graph"``: CUDA-graph steps on CUDA).

    transformers has already prepared ``generation_config`` and built the processors and stopping criteria this loop
    honours (length-only processors such as ``min_new_tokens`` per tree node); the settings of :data:`REFUSED` raise.

    Streaming: transformers keeps ``streamer=`` for itself when ``custom_generate`` is a callable (it sends the prompt
    and never passes the streamer on); the loop finds it in transformers' frame (:func:`caller_streamer`) and streams
    to it. ``tree_streamer=`` is the explicit form: it receives the prompt, every committed token and ``end()``. The
    Hub ``custom_generate`` folder maps one to the other.
    """
    # (first: transformers has already widened input_ids for num_beams / num_return_sequences)
    check_settings(generation_config, assistant_model=model_kwargs.get("assistant_model"))
    do_sample = bool(generation_config.do_sample)
    tree_budget = _budget_or_default(tree_budget, input_ids)
    mode = _mode_or_default(mode, weaver, input_ids)
    check_call(model, input_ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=tree_budget,
               verification=verification, do_sample=do_sample, attention_mask=model_kwargs.get("attention_mask"))
    check_processors(logits_processor)
    check_room(generation_config.max_length, input_ids.shape[1])
    streamer = streamer if streamer is not None else caller_streamer()  # (the prompt: already sent)
    if tree_streamer is not None:
        if streamer is not None and streamer is not tree_streamer:
            raise ValueError("give the streamer once: streamer= or tree_streamer=, not both")
        streamer = tree_streamer
        streamer.put(input_ids.cpu())
    ids, _ = _run(
        model, input_ids, drafter=drafter, weaver=weaver, step_options=step_options, target_step=target_step,
        mode=mode, tree_budget=tree_budget, max_new_tokens=generation_config.max_length - input_ids.shape[1],
        processors=logits_processor, do_sample=do_sample, verification=verification,
        stopping_criteria=stopping_criteria, streamer=streamer, generator=None, tree_policy=tree_policy or TreePolicy(),
        budget_policy=budget_policy,
    )
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=ids)
    return ids


def _budget_or_default(tree_budget, input_ids):
    """The device's default budget when none is given; an explicit budget is checked as given."""
    return default_tree_budget(getattr(input_ids, "device", "cpu")) if tree_budget is None else tree_budget


def _mode_or_default(mode, weaver, input_ids):
    """The device's default tree mode when none is given (a Weaver given on a CPU is then left unused)."""
    return default_tree_mode(getattr(input_ids, "device", "cpu"), weaver) if mode is None else mode


def _run(target, input_ids: torch.Tensor, *, drafter, weaver, step_options: StepOptions | None, target_step: str,
         **loop):
    """What both entry points run once the call is checked: the DFlash runner and the loop, with the models' linears
    packed for the generation where the device gains from it."""
    options = step_options or StepOptions()
    weaver = weaver if loop["mode"] == "weaver" else None  # (other trees never call it: nothing of it to pack)
    models = [m for m in (target, drafter, weaver) if m is not None]
    with generation_packing(options, input_ids.device, models, target_step):
        return _decode(target, input_ids[0], runner=DFlashRunner(drafter, target, options), weaver=weaver,
                       target_step=target_step, step_options=options, **loop)


def _in_transformers(frame) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return name == "transformers" or name.startswith("transformers.")


def caller_streamer(limit: int = 8):
    """The ``streamer=`` given to ``target.generate(..., custom_generate=<callable>, streamer=...)``, for
    :func:`generate` (which alone calls this).

    transformers passes a callable ``custom_generate`` only the arguments its signature adds to ``_sample``'s;
    ``streamer`` is one of ``_sample``'s, so transformers sends it the prompt and keeps it. It is still a local of
    transformers' ``generate``: the nearest transformers frame above :func:`generate`, which calls it directly or
    through the user's wrappers. That frame is trusted within ``limit`` calls. When it is farther and holds a
    streamer, or is near but not ``generate`` as this version knows it, this cannot tell: it warns (``tree_streamer=``
    is the explicit form) rather than drop a streamer silently. None when no transformers code called
    :func:`generate`, or ``custom_generate`` was a name (transformers then passes ``streamer`` on itself).
    """
    frame, depth = sys._getframe(2), 1  # (frame 1 is generate; 2 what called it)
    while frame is not None and not _in_transformers(frame):
        frame, depth = frame.f_back, depth + 1
    if frame is None:
        return None  # called directly: there is no target.generate to take a streamer from
    local = frame.f_locals
    known = "custom_generate" in local and "streamer" in local
    if known and not callable(local["custom_generate"]):
        return None
    if known and depth <= limit:
        return local["streamer"]
    # far: perhaps another call's streamer; near but unknown: perhaps another transformers version
    unsure = local["streamer"] is not None if known else depth <= limit
    if unsure:
        warnings.warn(f"generate() cannot tell whether target.generate was given a streamer=: the nearest "
                      f"transformers frame ({frame.f_globals.get('__name__')}.{frame.f_code.co_name}, {depth} calls "
                      f"up) is not transformers' generate within {limit} calls. Such a streamer receives the prompt "
                      "only; pass tree_streamer= to stream the generated tokens", stacklevel=3)
    return None


__all__ = ["LENGTH_PROCESSORS", "MODES", "PHASES", "REFUSED", "ROW_WISE_PROCESSORS", "TARGET_STEPS", "VERIFICATIONS",
           "DFlashRunner", "PhaseTimer", "SpeculativeStats", "caller_streamer", "generate", "refuse",
           "speculative_generate"]
