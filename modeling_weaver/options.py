"""Settings of one decoding step, as values: the tree policy (what tree is built) and the step options (how the
step's kernels run). docs/DESIGN.md §4 (trees) and §5 (the target's verify).

Both are frozen and hashable: a generation takes them as arguments (``speculative_generate(..., tree_policy=...,
step_options=...)``), fixed-shape steps are cached and their CUDA graphs keyed by them, and an A/B run makes the
other setting with ``dataclasses.replace``. Nothing here is read from a module global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from weaver_kernels.weaver_tree import cpu as native_cpu


@dataclass(frozen=True)
class TreePolicy:
    """How a Weaver tree is built (docs/DESIGN.md §4; chain and DDTree trees take no policy).

    Attributes:
        spine: start from DFlash's top-1 chain, stepped with the root in one round, then ``spine_rounds`` rounds
            (False: the paper's best-first rounds, one per depth at least).
        spine_rounds: rounds after the spine; a path leaves the spine for at most ``spine_rounds + 1`` Weaver tokens
            (None: 4 on CUDA; elsewhere none for trees of up to 5 drafts — there a round re-reads the Weaver's
            weights for one node and brought no acceptance at the CPU's budget of 5 — and one for larger trees, where
            it does: at budget 16 none gave MAL 2.66 on the CI check's prompts, under its floor; BENCHMARKS.md).
        spine_width: frontier entries per round after the spine (None: ``ceil(budget / 8)``).
        children_per_node: pool candidates each stepped node publishes to the frontier (the expand kernel picks
            them one by one: more costs time per round).
        root_children: candidates the root offers in all on a spine tree, the extra ones as leaves never stepped
            (None: half the budget); depth 1 is where most steps stop.
        fused_node_attention: each Weaver layer's RoPE, slot writes and attention as one
            ``weaver_kernels.node_attention`` op (None: on CUDA, where it is one launch instead of ~10, and on CPUs
            where the native kernels build: there the whole node step runs through them, ``tree.CpuWeaver``).
        pool_size: DFlash's top candidates per depth that the Weaver scores, at most its ``candidate_pool_size``
            (None: all of those on CUDA, 32 elsewhere — on a CPU each candidate's score reads its lm_head row, cold
            inside the loop, and the small trees a CPU verifies keep the same acceptance from 32).
    """

    spine: bool = True
    spine_rounds: int | None = None
    spine_width: int | None = None
    children_per_node: int = 8
    root_children: int | None = None
    fused_node_attention: bool | None = None
    pool_size: int | None = None

    def pool_on(self, device, weaver_pool: int) -> int:
        """Candidates per depth on ``device`` for a Weaver trained with a pool of ``weaver_pool``."""
        size = self.pool_size if self.pool_size is not None else (
            weaver_pool if torch.device(device).type == "cuda" else 32)
        if size < 1:
            raise ValueError(f"TreePolicy.pool_size must be >= 1, got {size}")
        return min(size, weaver_pool)

    def rounds_on(self, device, budget: int | None = None) -> int:
        """Rounds after the spine on ``device`` for a tree of ``budget`` drafts (None: any size)."""
        if self.spine_rounds is not None:
            return self.spine_rounds
        if torch.device(device).type == "cuda":
            return 4
        return 0 if budget is not None and budget <= 5 else 1

    def node_attention_on(self, device) -> bool:
        """Whether Weaver node steps on ``device`` use the fused node attention op."""
        if self.fused_node_attention is not None:
            return self.fused_node_attention
        kind = torch.device(device).type
        return kind == "cuda" or (kind == "cpu" and native_cpu.available())


@dataclass(frozen=True)
class StepOptions:
    """How a step's kernels run; none of them changes a committed token (docs/DESIGN.md §5).

    Attributes:
        int8_head: the drafter projects with an int8 copy of the target's lm_head (None: on CUDA, where the Triton
            kernel makes it faster, and on CPUs where torch has fbgemm's int8 GEMM, a quarter of the fp32 head's
            bytes; elsewhere the reference dequantises on every call).
        node_table: Weaver proposers gather node inputs from ``weaver.node_input_table`` (one table per Weaver, kept
            across generations: vocabulary × Weaver width in its dtype) instead of a norm and a matmul per round.
        gates_in_kernel: the GDN ops get the raw gate projections and form g and β inside their kernels.
        peel_root: the GDN tree verify runs the root as a recurrent step (budget + root trees solve one row block
            fewer, or a Neumann solve at half the padded size).
        neumann: the GDN tree verify gets the caller's depth bound, which lets it take the Neumann form.
        packed_linears: on CPU, the models' linears run on prepacked oneDNN weights during the generation
            (:func:`~modeling_weaver.packed.generation_packing`; not in compiled steps): MKL re-packs a weight on
            every call, most of a decoding GEMM's time. The packed copies are kept aside for the next call. None: on,
            when they fit in a quarter of the available memory (:func:`~modeling_weaver.packed.packing_fits`).
        tp_drafter: under tensor parallelism (several ranks of a ``torch.distributed`` group), ``"replicated"``:
            every rank drafts the same tree from the same inputs, no collective; ``"rank0"``: rank 0 drafts and
            broadcasts the tree, the other ranks' drafters never run (two broadcasts per step).
    """

    int8_head: bool | None = None
    node_table: bool = True
    gates_in_kernel: bool = True
    peel_root: bool = True
    neumann: bool = True
    packed_linears: bool | None = None
    tp_drafter: str = "replicated"

    def __post_init__(self):
        if self.tp_drafter not in ("replicated", "rank0"):
            raise ValueError(f'StepOptions.tp_drafter must be "replicated" or "rank0", got {self.tp_drafter!r}')

    def int8_head_on(self, device) -> bool:
        """Whether drafters on ``device`` project with the int8 head."""
        if self.int8_head is not None:
            return self.int8_head
        kind = torch.device(device).type
        if kind == "cpu":
            import weaver_kernels  # (options imports nothing of the step at module level)

            return weaver_kernels.cpu_int8_available()
        return kind == "cuda"


@dataclass(frozen=True)
class BudgetPolicy:
    """How ``tree_budget="auto"`` picks each step's tree size (docs/DESIGN.md §12).

    Attributes:
        sizes: the candidate draft counts whose costs are measured; 0 is a plain AR step (no speculation). Capped by
            ``max_size``. Eager steps choose among every count up to the largest (``every_size``).
        max_size: the largest tree built each step, then cut to the chosen size (None: 64 on CUDA, 8 elsewhere —
            fixed-shape drafting steps build this tree, and on a CPU building and verifying more than 8 drafts costs
            more than their extra acceptance brings, BENCHMARKS.md; at most
            :func:`~modeling_weaver.tree.max_tree_budget`).
        decay: how fast the acceptance calibration forgets (per step; the weight of the step ``k`` steps back is
            ``decay**k``).
        skip_after: after this many drafting steps in a row whose steady choice (draft time counted) is AR, or one
            whose drafted tree is not worth its verify either, the next steps skip drafting.
        max_backoff: when AR wins so, the next steps skip drafting, twice as many after each further AR verdict, up
            to this many (then one step drafts again to look at the drafter's confidence); counted in units of
            ``max(1, draft + tree time / AR step time)`` steps, so that looking costs at most ``1 / max_backoff`` of
            the time spent in AR steps.
        costs: a :class:`~modeling_weaver.decoding.budget.CostTable` to use as it is (None: measured on the first use
            and cached on disk, see :func:`~modeling_weaver.decoding.budget.step_costs`).
        recalibrate: measure again and replace the cached table (once: a later generation can read it).
        cache_dir: the folder of the cached tables (None: ``$MODELING_WEAVER_CACHE`` or ``~/.cache/modeling_weaver``).
        calibration_context: committed tokens under the calibration's steps (their attention reads them).
        calibration_reps: timed repetitions per measurement (the median is kept), after one warm-up.
        every_size: choose among every draft count up to the largest candidate (None: on eager steps, which verify
            any size; fixed-shape steps keep to their buckets); on eager steps every count up to ``dense_costs`` is
            then measured too, the cost of larger ones interpolated between the candidate sizes.
        dense_costs: with ``every_size``, the largest draft count whose cost is measured rather than interpolated: a
            verify of a few rows costs in steps of its GEMMs' row blocks, which a line between the candidate sizes
            hides (BENCHMARKS.md, the CPU budget).
        look_ahead: on eager steps, build each tree at the size chosen last, and on look-ahead steps this many
            drafts past it (the largest at first and after steps without drafting), so that a steady choice below
            the largest does not pay each step for drafting the largest (a draft's head projects one row per depth);
            a choice past the last raises the next build. 0: always the largest. None: 1 on a CPU, 0 on CUDA (where
            a draft of the largest tree costs little more than a smaller one, and one draft a step would take dozens
            of steps to grow).
        look_ahead_gap: the most steps between two look-aheads: between them a tree is built at the size chosen
            last. A look-ahead whose extra drafts are chosen, or a choice below the last, brings one the next step;
            after a look-ahead whose extra drafts are not chosen, the gap doubles up to this (0: every step looks
            ahead).
    """

    sizes: tuple[int, ...] = (0, 4, 8, 16, 32, 64)
    max_size: int | None = None
    decay: float = 0.9
    skip_after: int = 3
    max_backoff: int = 4
    costs: CostTable | None = None  # noqa: F821 - decoding.budget.CostTable (options imports nothing of the step)
    recalibrate: bool = False
    cache_dir: str | None = None
    calibration_context: int = 128
    calibration_reps: int = 5
    every_size: bool | None = None
    dense_costs: int = 16
    look_ahead: int | None = None
    look_ahead_gap: int = 8

    def choices(self, sizes: tuple[int, ...], target_step: str) -> tuple[int, ...]:
        """The sizes a generation of ``target_step`` chooses among, from the measured candidate ``sizes``."""
        every = target_step == "eager" if self.every_size is None else self.every_size
        if not every or not any(sizes):
            return sizes
        low = 1 if 0 in sizes else min(sizes)  # (below the least measured size nothing is cheaper)
        return tuple(sorted(set(sizes) | set(range(low, max(sizes) + 1))))

    def measured(self, sizes: tuple[int, ...], target_step: str) -> tuple[int, ...]:
        """The sizes whose costs a generation of ``target_step`` measures, from the candidate ``sizes`` (fixed-shape
        steps: those, their buckets)."""
        if target_step != "eager":
            return sizes
        dense = {s for s in self.choices(sizes, target_step) if s <= self.dense_costs}
        return tuple(sorted(set(sizes) | dense))

    def look_ahead_on(self, device) -> int:
        """Drafts past the last choice that an eager step's tree is built with on ``device`` (0: the largest)."""
        if self.look_ahead is not None:
            return self.look_ahead
        return 0 if torch.device(device).type == "cuda" else 1

    def max_size_on(self, device) -> int:
        """The largest candidate size on ``device`` before the target's own bound."""
        if self.max_size is not None:
            return self.max_size
        return 64 if torch.device(device).type == "cuda" else 8


__all__ = ["BudgetPolicy", "StepOptions", "TreePolicy"]
