"""The decoding step, split at its seams (docs/DESIGN.md §1). Imports run one way, top to bottom:

- :mod:`.loop` — :func:`~.loop._decode`, one short loop; :func:`~.loop.plan_steps` picks, once, the verifier, the
  proposer and whether whole steps run fused on the device; :class:`~.loop.SplitSteps` is one eager step.
- :mod:`.step_cache` — fixed-shape steps kept across generations, keyed by capacity, tree size and step options.
- :mod:`.drafting` — the proposer seam: draft + tree build (eager and fixed-shape).
- :mod:`.verify` — the verifier seam: prefill / verify / commit (eager: the
  :class:`~modeling_weaver.target.TargetAdapter` itself; fixed-shape: :class:`~.verify.StaticTarget`).
- :mod:`.fused` — whole greedy (and AR) steps on the device.
- :mod:`.graphs` — CUDA-graph capture and steps pipelined one ahead of the host.

The models (:mod:`..modeling_dflash`, :mod:`..modeling_weaver`) know none of this: what a fixed-shape step needs from
them (its attention kernel, its row positions) it passes as arguments.
"""
