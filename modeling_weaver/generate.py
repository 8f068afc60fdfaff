"""The speculative decoding loop: draft → tree → verify → accept → commit (docs/DESIGN.md §1), batch 1.

``speculative_generate`` is the plain-function API; ``generate`` is the same loop behind
``target.generate(input_ids, custom_generate=generate, drafter=..., weaver=...)``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers.generation import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    GenerateDecoderOnlyOutput,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    StoppingCriteriaList,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .accept import accept_greedy, accept_target_only, accept_traversal
from .captured import capture_flags, draft_head, static_draft, static_target
from .options import StepOptions, TreePolicy
from .pairing import check_pair
from .target import TargetAdapter
from .tree import node_depths, tree_budget_bound, tree_drafts, with_root

MODES = ("weaver", "ddtree", "chain")
VERIFICATIONS = ("target_only", "traversal")
# Processors whose output row depends only on that row's logits: applied to all tree nodes at once they give each
# node exactly the distribution sequential sampling would use.
ROW_WISE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
)
# Processors that read only input_ids' length (min_length, forced eos, ...): each tree node's length is known, so they
# are applied per depth exactly.
LENGTH_PROCESSORS = (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    ExponentialDecayLengthPenalty,
)

# What tree speculative decoding refuses, and why: generation settings and generate() arguments. README's "What is
# refused" lists exactly these names (a test checks).
REFUSED = {
    "num_beams": "beam search is another decoding method (num_beams must be 1)",
    "num_return_sequences": "one sequence per prompt (batch size 1)",
    "assistant_model": "the drafters are drafter= and weaver=; transformers' assisted decoding is another loop",
    "prompt_lookup_num_tokens": "prompt lookup is another drafter",
    "output_scores": "token ids only",
    "output_logits": "token ids only",
    "output_attentions": "token ids only",
    "output_hidden_states": "token ids only",
    "repetition_penalty": "depends on every earlier token: a tree node's history differs from its row's",
    "encoder_repetition_penalty": "depends on the prompt's tokens per row",
    "no_repeat_ngram_size": "depends on every earlier token",
    "encoder_no_repeat_ngram_size": "depends on the prompt's n-grams per row",
    "bad_words_ids": "multi-token bad words depend on earlier tokens (single-token ones are applied)",
    "sequence_bias": "multi-token sequences depend on earlier tokens (single-token ones are applied)",
    "prefix_allowed_tokens_fn": "depends on every earlier token",
    "guidance_scale": "classifier-free guidance runs a second model pass per token",
    "watermarking_config": "watermarks depend on earlier tokens",
    "attention_mask": "padded prompts (batch size 1, no padding)",
}
# The processor that each refused history-dependent setting builds, by class name.
_PROCESSOR_SETTING = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}


def refuse(name: str, value=None) -> ValueError:
    """The ValueError for a refused setting of :data:`REFUSED`."""
    shown = "" if value is None else f"={value!r}"
    return ValueError(f"{name}{shown} is not supported by tree speculative decoding: {REFUSED[name]}")


@dataclass
class SpeculativeStats:
    """Per-generation statistics. ``accepted_lengths[s]`` counts the tokens committed at verify step s (bonus incl.)."""

    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    phase_ms: dict[str, float] = field(default_factory=dict)  # summed over steps, when timed (PhaseTimer)

    @property
    def num_steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        """MAL τ: tokens committed per verify step, bonus included."""
        return sum(self.accepted_lengths) / max(1, self.num_steps)


TARGET_STEPS = ("eager", "static", "graph", "compiled")


# Loop phases in report order; eager steps time draft, tree, verify, accept, commit; fixed-shape steps draft+tree
# instead of draft and tree; a fused greedy step is one "step" (so the phases of one step never overlap).
PHASES = ("draft", "tree", "draft+tree", "verify", "accept", "commit", "step")


class PhaseTimer:
    """Time spent in each phase of the loop (draft, tree — or draft+tree for a fixed-shape proposer —, verify,
    accept, commit), summed over steps.

    CUDA events on CUDA (no sync inside the loop; :meth:`totals_ms` synchronises once), wall time elsewhere.
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: dict[str, list] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans[phase].append((start, end))
        else:
            start = time.perf_counter()
            yield
            self.spans[phase].append(1e3 * (time.perf_counter() - start))

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(s.elapsed_time(e) for s, e in v) for k, v in self.spans.items()}
        return {k: sum(v) for k, v in self.spans.items()}


def _untimed(phase: str):
    return contextlib.nullcontext()


def _check_arguments(target, drafter, weaver, mode: str, tree_budget: int, verification: str | None, do_sample: bool):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "weaver" and weaver is None:
        raise ValueError('mode="weaver" needs a Weaver adapter: pass weaver=WeaverModel, or use mode="ddtree"/"chain"')
    if not isinstance(tree_budget, int) or tree_budget < 1:
        raise ValueError(f"tree_budget counts draft nodes and must be an integer >= 1, got {tree_budget!r}")
    if verification is not None:
        if verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS} or None, got {verification!r}")
        if not do_sample:
            raise ValueError("verification only applies when sampling (do_sample=True); greedy is always exact")
    if drafter is None:
        raise ValueError("a DFlash drafter is required: pass drafter=DFlashDraftModel")
    check_pair(
        target.config, drafter.config, weaver.config if weaver is not None else None,
        target_vocab_size=target.get_output_embeddings().weight.shape[0],
        target_embed_dim=target.get_input_embeddings().weight.shape[1],
    )


def _check_prompt(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a 2-D tensor [batch, length]")
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding supports batch size 1 only, got batch {input_ids.shape[0]}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")


def _row_wise(proc) -> bool:
    if isinstance(proc, SequenceBiasLogitsProcessor):  # (NoBadWords too) one-token sequences: a fixed bias per row
        seqs = proc.sequence_bias if isinstance(proc.sequence_bias, dict) else [s for s, _ in proc.sequence_bias]
        return all(len(seq) == 1 for seq in seqs)
    return isinstance(proc, ROW_WISE_PROCESSORS)


def _check_processors(processors: LogitsProcessorList):
    for proc in processors:
        if _row_wise(proc) or isinstance(proc, LENGTH_PROCESSORS):
            continue
        name = type(proc).__name__
        if name in _PROCESSOR_SETTING:
            raise refuse(_PROCESSOR_SETTING[name])
        raise ValueError(
            f"{name} is not supported by tree speculative decoding: only processors that act on each distribution "
            f"independently ({', '.join(p.__name__ for p in ROW_WISE_PROCESSORS)}) or on its length only "
            f"({', '.join(p.__name__ for p in LENGTH_PROCESSORS)}) are"
        )


def _check_settings(generation_config, **arguments) -> None:
    """Refuse the settings of :data:`REFUSED` that a prepared ``generation_config`` or ``generate()``'s own
    ``arguments`` carry (processors are checked by :func:`_check_processors`)."""
    for name, value in arguments.items():
        if value is not None:
            raise refuse(name)
    for name in ("num_beams", "num_return_sequences"):
        if (getattr(generation_config, name, None) or 1) > 1:
            raise refuse(name, getattr(generation_config, name))
    if getattr(generation_config, "prompt_lookup_num_tokens", None) is not None:
        raise refuse("prompt_lookup_num_tokens", generation_config.prompt_lookup_num_tokens)
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, name, False):
            raise refuse(name, True)
    # transformers' warpers check these when it samples; top-k/top-p values it would then ignore are refused always
    if generation_config.do_sample and generation_config.temperature is not None:
        TemperatureLogitsWarper(generation_config.temperature)
    if generation_config.top_k is not None and generation_config.top_k != 0:
        TopKLogitsWarper(generation_config.top_k)
    if generation_config.top_p is not None:
        TopPLogitsWarper(generation_config.top_p)


def _prepare(target, input_ids: torch.Tensor, generation_config, max_new_tokens: int | None, kwargs: dict):
    """``generation_config`` (default: the target's) with ``kwargs`` applied and prepared as ``target.generate``
    prepares it (special-token tensors, lengths), and the processors and stopping criteria it builds from it.
    Without a length from the arguments or either config, ``max_new_tokens`` is 128."""
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    configs = (generation_config, target.generation_config)
    unset = lambda name: kwargs.get(name) is None and all(getattr(c, name, None) is None for c in configs)  # noqa: E731
    has_default_max_length, has_default_min_length = unset("max_length"), unset("min_length")
    if has_default_max_length and unset("max_new_tokens"):
        kwargs["max_new_tokens"] = 128
    config, model_kwargs = target._prepare_generation_config(generation_config, **kwargs)
    model_kwargs.pop("output_attentions", None), model_kwargs.pop("output_hidden_states", None)
    if model_kwargs:  # not generation settings: transformers would hand them to the model's forward
        name = next(iter(model_kwargs))
        if name in REFUSED:
            raise refuse(name)
        raise ValueError(f"{name} is not a generation setting speculative_generate takes")
    _check_settings(config)
    target._prepare_special_tokens(config, True, device=input_ids.device, batch_size=1)
    config = target._prepare_generated_length(config, has_default_max_length, has_default_min_length, "input_ids",
                                              input_ids.shape[1], input_ids)
    if config.max_length <= input_ids.shape[1]:
        raise ValueError(f"max_length {config.max_length} leaves no room after the {input_ids.shape[1]}-token prompt")
    processors = target._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(), device=input_ids.device, model_kwargs={},
    )
    stopping = target._get_stopping_criteria(generation_config=config, stopping_criteria=StoppingCriteriaList())
    return config, processors, stopping


def _check_budget(target, tree_budget: int, device) -> None:
    bound, why = tree_budget_bound(target, device)
    if tree_budget > bound:
        raise ValueError(f"tree_budget {tree_budget} exceeds max_tree_budget(target, {device}) = {bound}: {why}")


class DFlashRunner:
    """Drives a DFlash drafter across steps: its KV cache of projected context, block inputs and the target's lm_head.

    Any object with the same ``draft`` method can stand in for it (tests plant drafts through this seam).
    """

    def __init__(self, drafter, target, options: StepOptions = StepOptions()):
        self.drafter = drafter
        self.embed_tokens = target.get_input_embeddings()
        self.block_size = drafter.config.block_size
        self.feature_layer_ids = list(drafter.config.target_layer_ids)
        self.dtype = next(drafter.parameters()).dtype
        self.head = draft_head(target, self.dtype, options.int8_head_on(self.embed_tokens.weight.device))
        self.cache = drafter.new_cache()

    def draft(self, bonus: int, context: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block ``[bonus, MASK…]`` at positions ``n..n+B-1``, reading ``context [C, n_layers·H]``: the target
        features of the positions ``n-C..n-1`` not yet in the drafter's cache. Returns the drafter's hidden states
        and marginal logits for depths ``1..B-1`` (``[B-1, H]``, ``[B-1, V]``)."""
        device = self.head.weight.device
        block = self.drafter.block_embeddings(torch.tensor([bonus], device=device), self.embed_tokens).to(self.dtype)
        position_ids = torch.arange(n - context.shape[0], n + self.block_size, device=device)[None]
        hidden = self.drafter(
            noise_embedding=block, target_hidden=context[None].to(self.dtype), position_ids=position_ids,
            past_key_values=self.cache, use_cache=True,
        )[0, 1:]
        self.drafter.crop_cache(self.cache, n)  # block K/V never persist
        return hidden, self.head(hidden)


class _Output:
    """Emitted tokens, stopping rules and the streamer, one token at a time.

    The ids live on the host, so stopping rules and the streamer read them without waiting for the device: a device
    tensor here would make each emitted token wait behind the step already queued ahead (a copy to, or a read from,
    the device is ordered after it). Stopping criteria therefore see CPU ``input_ids`` (transformers' own criteria
    move their tensors to ``input_ids.device``)."""

    def __init__(self, prompt: torch.Tensor, max_new_tokens: int, stopping_criteria: StoppingCriteriaList, streamer):
        self.device, self.prompt_len = prompt.device, prompt.shape[0]
        self._ids = torch.empty(1, self.prompt_len + max_new_tokens, dtype=prompt.dtype)
        self._ids[0, :self.prompt_len] = prompt.cpu()
        self.length = self.prompt_len
        self.stopping_criteria, self.streamer = stopping_criteria, streamer
        self.done = False

    @property
    def ids(self) -> torch.Tensor:
        """``[1, prompt + emitted]`` on the host."""
        return self._ids[:, :self.length]

    def emit(self, tokens: list[int]) -> int:
        """Append tokens until a stopping rule fires or ``max_new_tokens`` are out; returns how many were kept."""
        kept = 0
        for tok in tokens:
            if self.done:
                break
            self._ids[0, self.length] = tok
            self.length += 1
            kept += 1
            self.done = bool(self.stopping_criteria(self.ids, None).any()) or self.length == self._ids.shape[1]
        if kept and self.streamer is not None:
            self.streamer.put(self.ids[0, -kept:].clone())
        return kept


@torch.no_grad()
def _decode(
    target,
    prompt: torch.Tensor,
    *,
    runner: DFlashRunner,
    weaver,
    mode: str,
    tree_budget: int,
    max_new_tokens: int,
    processors: LogitsProcessorList,
    do_sample: bool,
    verification: str | None,
    stopping_criteria: StoppingCriteriaList,
    streamer,
    generator: torch.Generator | None,
    target_step: str = "eager",
    timer: PhaseTimer | None = None,
    accept=None,
    tree_policy: TreePolicy = TreePolicy(),
    step_options: StepOptions = StepOptions(),
) -> tuple[torch.Tensor, SpeculativeStats]:
    """The loop. ``timer`` times its phases into ``stats.phase_ms``; ``accept(tree, scores)`` → ``Acceptance``
    replaces the acceptance rule (the benchmark's acceptance replay, :mod:`modeling_weaver.lab.replay`; with a device
    ``accept.tensors`` it also runs inside fused steps)."""
    timed = timer or _untimed
    if target_step not in TARGET_STEPS:
        raise ValueError(f"target_step must be one of {TARGET_STEPS}, got {target_step!r}")
    if verification is None:
        verification = "traversal" if mode == "weaver" else "target_only"
    stats = SpeculativeStats()
    out = _Output(prompt, max_new_tokens, stopping_criteria, streamer)
    embed_tokens = target.get_input_embeddings()
    lm_head = target.get_output_embeddings()
    max_length = prompt.shape[0] + max_new_tokens + tree_budget + 2
    # every tree drafts within one block: the bound picks the GDN layers' verify kernel (None: no bound known)
    depth = runner.block_size - 1 if getattr(runner, "block_size", None) else None
    if target_step == "eager":
        target_cache = TargetAdapter(target, max_length=max_length, feature_layer_ids=runner.feature_layer_ids,
                                     max_tree_depth=depth, options=step_options)
    else:  # kept per target and drafter: later generations replay the same graphs
        flags = capture_flags(target_step, prompt.device)
        target_cache = static_target(target, max_length, tree_budget + 1, runner.feature_layer_ids, **flags,
                                     max_tree_depth=depth, options=step_options)
        if type(runner) is DFlashRunner:  # draft + tree build as one fixed-shape step
            runner = static_draft(runner.drafter, target, max_length, capture=flags["capture"],
                                  options=step_options).proposer(
                mode, tree_budget, weaver if mode == "weaver" else None, compile=flags["compile"], policy=tree_policy)
    if target_cache.max_tree_nodes is not None and tree_budget + 1 > target_cache.max_tree_nodes:
        raise ValueError(f"tree_budget {tree_budget} is too large for this hybrid target on {target_cache.device}: the "
                         f"GDN tree kernel verifies at most {target_cache.max_tree_nodes} nodes (budget + root)")

    by_length = any(not _row_wise(proc) for proc in processors)

    def distribution(logits: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        """Processed scores of every node (``parents``: the tree's; None: one row after the emitted ids)."""
        scores = logits.float()
        if processors and (not by_length or parents is None):  # the ids so far stand in for every row
            scores = processors(out.ids.to(logits.device).expand(logits.shape[0], -1), scores)
        elif processors:  # a node of depth d continues the emitted ids by d tokens: its processors see that length
            depths = node_depths(parents.to(logits.device))
            for d in sorted(set(depths.tolist())):
                rows = (depths == d).nonzero()[:, 0]
                ids = torch.cat([out.ids, out.ids.new_zeros(1, d)], 1).to(logits.device)  # (length-only readers)
                scores[rows] = processors(ids.expand(rows.shape[0], -1), scores[rows])
        return scores.softmax(-1) if do_sample else scores

    def first_token(logits: torch.Tensor) -> int:
        scores = distribution(logits[None])
        if do_sample:
            return int(torch.multinomial(scores.cpu(), 1, generator=generator))
        return int(scores.argmax(-1))

    verified = target_cache.prefill(prompt)
    context, last_hidden = verified.features, verified.hidden[-1]
    bonus = first_token(verified.logits[-1])
    stats.num_new_tokens += out.emit([bonus])

    # Greedy with a fixed-shape proposer: whole steps run on the device (one graph each), from the first one on.
    fused = None
    # (fused steps take the target's argmax as it is: not with processors)
    if (hasattr(runner, "propose") and not do_sample and not processors
            and (accept is None or hasattr(accept, "tensors"))):
        fused = runner.draft.fused_step(runner, target_cache, accept)
        if not out.done:  # (arming runs the drafter over the prompt: not for an output that is complete already)
            # untimed: the prompt's drafter pass is no step's phase (decode tokens/s include it all the same)
            fused.arm(bonus, context, last_hidden)

    while not out.done:
        if fused is not None and fused.ready:  # from here on, one fused step per iteration (pipelined on CUDA)
            # Launch a step ahead only if one more fits in the caches and the step in flight (≤ block new tokens)
            # cannot reach max_new_tokens: a step launched after the last one is a whole step of wasted GPU time.
            block = runner.draft.block_size
            with contextlib.closing(fused.run(
                    ahead=lambda: target_cache.length + block + tree_budget + 1 <= target_cache.max_length
                    and stats.num_new_tokens + block < max_new_tokens)) as steps:
                while not out.done:
                    with timed("step"):  # (pipelined: a span holds the GPU time of the step launched ahead in it)
                        path_tokens, bonus = next(steps)
                    stats.accepted_lengths.append(len(path_tokens))
                    stats.tree_sizes.append(tree_budget + 1)
                    stats.num_new_tokens += out.emit(path_tokens[1:] + [bonus])
            break
        if hasattr(runner, "propose"):  # StaticProposer: the tree comes out of the same (captured) step
            with timed("draft+tree"):
                draft_hidden, draft_logits, tree = runner.propose(bonus, context, target_cache.length, last_hidden)
        else:
            with timed("draft"):
                draft_hidden, draft_logits = runner.draft(bonus, context, target_cache.length)
            tree = None

        if tree is None:
            with timed("tree"):
                tree = with_root(bonus, tree_drafts(mode, bonus, draft_hidden, draft_logits, tree_budget, weaver,
                                                    last_hidden, embed_tokens, lm_head.weight, policy=tree_policy))

        with timed("verify"):
            verified = target_cache.verify(tree)
        with timed("accept"):
            scores = distribution(verified.logits, tree.parents)
            if accept is not None:
                accepted = accept(tree, scores)
            elif not do_sample:
                accepted = accept_greedy(tree, scores)
            elif verification == "traversal":
                accepted = accept_traversal(tree, scores, generator)
            else:
                accepted = accept_target_only(tree, scores, generator)
        with timed("commit"):
            target_cache.commit(accepted.path)
        context = verified.features[accepted.path]
        last_hidden = verified.hidden[accepted.path[-1]]
        bonus = accepted.bonus

        stats.accepted_lengths.append(len(accepted.path))
        stats.tree_sizes.append(len(tree))
        stats.num_new_tokens += out.emit(tree.tokens[accepted.path[1:]].tolist() + [bonus])

    if timer is not None:
        stats.phase_ms = timer.totals_ms()
    if streamer is not None:
        streamer.end()
    return out.ids.to(out.device, copy=True), stats  # (a copy: not a view of the host buffer)


def speculative_generate(
    target,
    input_ids: torch.Tensor,
    *,
    drafter,
    weaver=None,
    mode: str = "weaver",
    tree_budget: int = 64,
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
            ``"chain"`` (plain DFlash).
        tree_budget: draft nodes per tree (the root/bonus token is extra), at most
            :func:`~modeling_weaver.tree.max_tree_budget`.
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
        generation_config, generation_kwargs: as ``target.generate`` takes them (default: the target's
            ``generation_config``), prepared as it prepares them; lengths (``min_new_tokens``, ``min_length``, ...)
            and processors that act per distribution or per length are applied, the settings of :data:`REFUSED`
            raise a ``ValueError`` naming them.

    Returns:
        ``[1, T + new]`` token ids, and a :class:`SpeculativeStats` when ``return_stats=True``.
    """
    _check_prompt(input_ids)
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    _check_arguments(target, drafter, weaver, mode, tree_budget, verification, do_sample)
    _check_budget(target, tree_budget, input_ids.device)
    settings = dict(generation_kwargs, do_sample=do_sample)
    if do_sample:  # (greedy: transformers ignores them, and so do we once they are checked)
        settings.update(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    else:
        settings.update({k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None})
    if eos_token_id is not None:
        settings["eos_token_id"] = eos_token_id
    config, processors, stopping = _prepare(target, input_ids, generation_config, max_new_tokens, settings)
    _check_processors(processors)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    options = step_options or StepOptions()
    ids, stats = _decode(
        target, input_ids[0], runner=DFlashRunner(drafter, target, options), weaver=weaver, mode=mode,
        tree_budget=tree_budget, max_new_tokens=config.max_length - input_ids.shape[1], processors=processors,
        do_sample=do_sample, verification=verification, stopping_criteria=stopping, streamer=streamer,
        generator=generator, target_step=target_step, timer=timer, tree_policy=tree_policy or TreePolicy(),
        step_options=options,
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
    mode: str = "weaver",
    tree_budget: int = 64,
    verification: str | None = None,
    tree_streamer=None,
    target_step: str = "eager",
    tree_policy: TreePolicy | None = None,
    step_options: StepOptions | None = None,
    **model_kwargs,
):
    """``target.generate(input_ids, custom_generate=generate, drafter=..., weaver=..., mode=..., tree_budget=...)``.

    ``target_step``, ``tree_policy``, ``step_options`` as in :func:`speculative_generate` (``"graph"``: CUDA-graph
    steps on CUDA).

    transformers has already prepared ``generation_config`` and built the processors and stopping criteria this loop
    honours (length-only processors such as ``min_new_tokens`` per tree node); the settings of :data:`REFUSED` raise.

    Streaming: transformers keeps ``streamer=`` for itself when ``custom_generate`` is a callable (it sends the prompt
    and never passes the streamer on), so pass yours as ``tree_streamer=``: it receives the prompt, every committed
    token and ``end()``. The Hub ``custom_generate`` folder does this for you.
    """
    # (first: transformers has already widened input_ids for num_beams / num_return_sequences)
    _check_settings(generation_config, assistant_model=model_kwargs.get("assistant_model"))
    _check_prompt(input_ids)
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise refuse("attention_mask")
    do_sample = bool(generation_config.do_sample)
    _check_arguments(model, drafter, weaver, mode, tree_budget, verification, do_sample)
    _check_budget(model, tree_budget, input_ids.device)
    _check_processors(logits_processor)
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    if max_new_tokens < 1:
        raise ValueError(f"max_length {generation_config.max_length} leaves no room after the prompt")
    if tree_streamer is not None:
        streamer = tree_streamer
        streamer.put(input_ids.cpu())
    options = step_options or StepOptions()
    ids, _ = _decode(
        model, input_ids[0], runner=DFlashRunner(drafter, model, options), weaver=weaver, mode=mode,
        tree_budget=tree_budget, max_new_tokens=max_new_tokens, processors=logits_processor, do_sample=do_sample,
        verification=verification, stopping_criteria=stopping_criteria, streamer=streamer, generator=None,
        target_step=target_step, tree_policy=tree_policy or TreePolicy(), step_options=options,
    )
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=ids)
    return ids
