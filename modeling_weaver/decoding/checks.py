"""What a generation accepts (docs/DESIGN.md §6): the arguments, the prompt, the generation settings and logits
processors that tree speculative decoding honours exactly, and the ones it refuses (:data:`REFUSED`, with why).
"""

from __future__ import annotations

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


from ..pairing import check_pair
from ..tree import tree_budget_bound

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


def _check_arguments(target, drafter, weaver, mode: str, tree_budget: int, verification: str | None, do_sample: bool):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "weaver" and weaver is None:
        raise ValueError('mode="weaver" needs a Weaver adapter: pass weaver=WeaverModel, or use mode="ddtree"/"chain"')
    if tree_budget != "auto" and (not isinstance(tree_budget, int) or tree_budget < 1):
        raise ValueError(f'tree_budget counts draft nodes and must be an integer >= 1 or "auto", got {tree_budget!r}')
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
