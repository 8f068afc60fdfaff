"""Fixed-shape steps kept across generations (docs/DESIGN.md §1): per model, cache capacity (rounded up to a power
of two), tree size and :class:`~modeling_weaver.options.StepOptions`, so later generations replay the same CUDA graphs
and compiled steps. :func:`release_static_targets` frees them.
"""

from __future__ import annotations

import weakref

import torch

from ..accept import DeviceAcceptance
from ..options import StepOptions
from ..target import TargetAdapter, weights_key
from .drafting import StaticDraft, StaticProposer
from .fused import FusedGreedyStep
from .verify import BucketedTarget, StaticTarget


_STATIC_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept(steps: dict, key, weights, build):
    """``steps[key]``, made by ``build()`` if missing; when the tensors ``weights()`` names changed since it was made,
    every step in ``steps`` is dropped first: they all read the old tensors (and keep them alive)."""
    if key in steps and steps[key].weights != weights():
        steps.clear()
    if key not in steps:
        step = build()
        step.weights = weights()  # (after building: a target's adapter may have moved weights into merged tensors)
        steps[key] = step
    return steps[key]


def cache_bucket(max_length: int) -> int:
    """Capacity of the static caches for ``max_length``: the next power of two, at least 256 (prompts of any length
    up to it share one set of graphs and compiled steps)."""
    return max(256, 1 << (max_length - 1).bit_length())


def capture_flags(target_step: str, device) -> dict:
    """``static_target``'s ``capture`` and ``compile`` for a loop ``target_step``: ``"static"`` (fixed shapes,
    eager), ``"graph"`` (CUDA graphs on CUDA), ``"compiled"`` (``torch.compile``d tree pass, in CUDA graphs on CUDA)."""
    cuda = torch.device(device).type == "cuda"
    return {"capture": target_step in ("graph", "compiled") and cuda, "compile": target_step == "compiled"}


def static_target(model, max_length: int, num_nodes: int, feature_layer_ids=(), capture: bool | None = None,
                  compile: bool = False, max_tree_depth: int | None = None,
                  options: StepOptions = StepOptions()) -> StaticTarget:
    """The :class:`StaticTarget` of ``model`` for this capacity bucket, tree size and ``options``, reset for a new
    generation. ``max_tree_depth``, ``options``: as :class:`~modeling_weaver.target.TargetAdapter`'s.

    Capacity is ``max_length`` rounded up to a power of two (at least 256), so prompts of any length up to it share
    one set of graphs (and, with ``compile``, one compiled tree pass). The buffers live as long as the model
    (:func:`release_static_targets` frees them).
    """
    capacity = cache_bucket(max_length)
    steps = _STATIC_TARGETS.setdefault(model, {})
    key = (capacity, num_nodes, tuple(feature_layer_ids), capture, compile, max_tree_depth, options)

    def build() -> StaticTarget:
        adapter = TargetAdapter(model, capacity, feature_layer_ids, max_tree_depth, options)
        if compile:
            adapter.compile_tree_step()
        return StaticTarget(adapter, num_nodes, capture=capture)

    step = _kept(steps, key, lambda: weights_key(model), build)
    step.adapter.reset()
    return step


def static_buckets(model, max_length: int, sizes, feature_layer_ids=(), capture: bool | None = None,
                   compile: bool = False, max_tree_depth: int | None = None,
                   options: StepOptions = StepOptions()) -> BucketedTarget:
    """The :class:`~.verify.BucketedTarget` of ``model`` with steps of ``sizes`` nodes, kept and reset as
    :func:`static_target` keeps its steps (the same capacity buckets)."""
    capacity = cache_bucket(max_length)
    steps = _STATIC_TARGETS.setdefault(model, {})
    sizes = tuple(sorted(set(sizes)))
    key = ("buckets", capacity, sizes, tuple(feature_layer_ids), capture, compile, max_tree_depth, options)

    def build() -> BucketedTarget:
        adapter = TargetAdapter(model, capacity, feature_layer_ids, max_tree_depth, options)
        if compile:
            adapter.compile_tree_step()
        return BucketedTarget(adapter, sizes, capture=capture)

    step = _kept(steps, key, lambda: weights_key(model), build)
    step.adapter.reset()
    return step


def static_draft(drafter, target, max_length: int, capture: bool | None = None,
                 options: StepOptions = StepOptions()) -> StaticDraft:
    """The :class:`StaticDraft` of ``drafter`` for this capacity bucket and ``options`` (as :func:`static_target`),
    kept on it."""
    capacity = cache_bucket(max_length)
    steps = _STATIC_TARGETS.setdefault(drafter, {})
    key = ("draft", capacity, id(target), capture, options)
    # what its graphs read: the drafter, the target's embedding and lm_head (the fused steps built on it go with it)
    def weights() -> tuple:
        return weights_key(drafter, target.get_input_embeddings(), target.get_output_embeddings())

    return _kept(steps, key, weights, lambda: StaticDraft(drafter, target, capacity, capture=capture, options=options))


def release_static_targets(model) -> None:
    """Drop the cached steps (caches and CUDA graphs) of ``model`` (a target or a drafter)."""
    _STATIC_TARGETS.pop(model, None)


def whole_steps(proposer: StaticProposer, target, key: tuple, build):
    """``build()`` — whole steps on ``proposer`` and ``target`` (a ``.target`` attribute), as ``key`` (``"fused"``
    or ``"auto"`` first) — kept with the proposer's drafter (their graphs read both one's buffers)."""
    steps = proposer.draft._steps
    # steps built on a target step since replaced (its weights moved) would keep it alive, and its id reusable
    live = list(_STATIC_TARGETS.get(target.adapter.model, {}).values())
    for k in [k for k, v in steps.items() if k[0] in ("fused", "auto") and not any(v.target is t for t in live)]:
        del steps[k]
    if key not in steps:
        steps[key] = build()
    return steps[key]


def fused_step(proposer: StaticProposer, target: StaticTarget, acceptance: DeviceAcceptance | None = None
               ) -> FusedGreedyStep:
    """The :class:`~.fused.FusedGreedyStep` of ``proposer`` and ``target``, kept with the proposer's drafter (its
    graph reads their buffers); ``acceptance`` replaces greedy acceptance on the device."""
    key = ("fused", id(proposer), id(target), id(acceptance))
    return whole_steps(proposer, target, key, lambda: FusedGreedyStep(proposer, target, acceptance))
