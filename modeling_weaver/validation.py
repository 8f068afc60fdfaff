"""What a generation accepts (docs/DESIGN.md §11), checked once per call before any work: the arguments, the prompt,
the models, the generation settings and logits processors that tree speculative decoding honours exactly, and the
ones it refuses (:data:`REFUSED`, with why).

Each bad input gets a ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value) whose message
names the argument and says what is allowed, instead of an error from deep inside torch or transformers. Both entry
points of :mod:`modeling_weaver.generate` run :func:`check_call`; this module imports no decoding code.
"""

from __future__ import annotations

import torch
from transformers.generation import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
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

from .pairing import check_pair
from .tree import tree_budget_bound

__all__ = ["LENGTH_PROCESSORS", "MODES", "REFUSED", "ROW_WISE_PROCESSORS", "VERIFICATIONS", "check_call",
           "check_processors", "check_room", "check_settings", "prepare_settings", "refuse", "row_wise"]

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
    "attention_mask": "masking prompt tokens means a padded prompt (batch size 1, no padding): pass the unpadded "
                      "prompt, or a mask of all ones",
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
# The model_type each model argument takes, and what to call it in a message.
_ROLES = (("target", None, "transformers causal LM"), ("drafter", "dflash", "DFlashDraftModel"),
          ("weaver", "weaver", "WeaverModel"))


def refuse(name: str, value=None) -> ValueError:
    """The ValueError for a refused setting of :data:`REFUSED`."""
    shown = "" if value is None else f"={value!r}"
    return ValueError(f"{name}{shown} is not supported by tree speculative decoding: {REFUSED[name]}")


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value, meaning: str = "") -> None:
    if not is_int(value):
        raise TypeError(f"{name} {meaning}must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} {meaning}must be an int >= 1, got {value!r}")


def _vocab_size(target) -> int:
    return target.get_input_embeddings().weight.shape[0]


def _check_prompt(target, input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a 2-D tensor [batch, length]")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long, as a tokenizer returns them), got dtype "
                        f"{input_ids.dtype}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids has batch {input_ids.shape[0]}: speculative decoding supports batch size 1 only")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give a prompt of at least one token")
    vocab = _vocab_size(target)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the target's vocabulary: ids "
                         f"must be in [0, {vocab - 1}]")


def _check_attention_mask(input_ids, attention_mask) -> None:
    # (as a tokenizer returns it: accepted when it masks nothing)
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor like input_ids, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}, input_ids "
                         f"{list(input_ids.shape)}: they must match")
    if not bool((attention_mask == 1).all()):
        raise refuse("attention_mask")


def _check_model(name: str, model) -> None:
    slot = {role: wanted for role, _, wanted in _ROLES}
    belongs = {kind: role for role, kind, _ in _ROLES if kind is not None}
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in belongs and belongs[kind] != name:
        swapped = " (drafter and weaver swapped?)" if name != "target" else ""
        raise TypeError(f"{name}= got a {type(model).__name__} (model_type {kind!r}): {name}= takes a "
                        f"{slot[name]}; this one belongs in {belongs[kind]}={swapped}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name}= must be a loaded {slot[name]} (a torch module), got {type(model).__name__}")
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None and any(hasattr(m, "_hf_hook") for m in model.modules()):
        raise ValueError(f"{name}= has weights offloaded by accelerate (e.g. '{meta}' on the meta device, fetched at "
                         "each call): the tree loop reads every layer's weights where they live. Load it with a "
                         "device_map that gives every layer a device (no 'cpu'/'disk' offload next to GPUs), or on "
                         "one device")
    if meta is not None:
        raise ValueError(f"{name}= has parameters on the meta device (e.g. '{meta}'): its weights were never loaded. "
                         "Load it with from_pretrained (without device_map='meta' / init_empty_weights) or "
                         "load_state_dict(..., assign=True) first")


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def _check_devices(target, input_ids, drafter, weaver) -> None:
    """The prompt sits with the target's input embedding (the first layer of a target split by device_map), and a
    Weaver with the drafter whose hidden states it reads; the drafter itself may sit on any of the target's
    devices."""
    home = target.get_input_embeddings().weight.device
    if input_ids.device != home:
        raise ValueError(f"input_ids is on {input_ids.device} but the target's input embedding is on {home}: move the "
                         f"prompt there (input_ids.to('{home}'))")
    if weaver is not None and _device_of(weaver) != _device_of(drafter):
        raise ValueError(f"weaver= is on {_device_of(weaver)} but drafter= on {_device_of(drafter)}: the Weaver reads "
                         "the drafter's hidden states, so put both on one device")


def _check_eos(target, eos_token_id) -> None:
    if eos_token_id is None:
        return
    ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if isinstance(eos_token_id, torch.Tensor):
        ids = eos_token_id.flatten().tolist() if not eos_token_id.is_floating_point() else [eos_token_id]
    if not all(is_int(i) for i in ids):  # ([]: no eos at all, the target's overridden)
        raise TypeError(f"eos_token_id must be a token id (int) or a list of them, got {eos_token_id!r}")
    vocab = _vocab_size(target)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} is outside the target's vocabulary: ids must be in [0, {vocab - 1}]")


def check_call(target, input_ids, *, drafter, weaver, mode: str, tree_budget: int | str, verification: str | None,
               do_sample: bool, temperature=1.0, eos_token_id=None, attention_mask=None, max_new_tokens=None) -> None:
    """The arguments of a call of either entry point: the models (kind, slot, loaded weights, a pair that fits),
    the prompt and its ``attention_mask``, ``mode`` / ``verification`` / ``do_sample`` / ``temperature`` kinds,
    ``tree_budget`` and ``max_new_tokens`` counts, ``eos_token_id`` type and range, and the tree budget's bound on
    this device."""
    _check_model("target", target)  # (first: the prompt check reads the target's vocabulary)
    _check_prompt(target, input_ids)
    _check_attention_mask(input_ids, attention_mask)
    if tree_budget != "auto":  # ("auto": sized per step, docs/DESIGN.md §12)
        _check_count("tree_budget", tree_budget, 'counts draft nodes (or is "auto") and ')
    if max_new_tokens is not None:
        _check_count("max_new_tokens", max_new_tokens)
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if do_sample and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise TypeError(f"temperature must be a number > 0 when do_sample=True, got {temperature!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if verification is not None:
        if verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS} or None, got {verification!r}")
        if not do_sample:
            raise ValueError("verification only applies when sampling (do_sample=True); greedy is always exact")
    if drafter is None:
        raise ValueError("a DFlash drafter is required: pass drafter=DFlashDraftModel")
    _check_model("drafter", drafter)
    if weaver is not None:
        _check_model("weaver", weaver)
    elif mode == "weaver":
        raise ValueError('mode="weaver" needs a Weaver adapter: pass weaver=WeaverModel, or use mode="ddtree"/"chain"')
    _check_devices(target, input_ids, drafter, weaver if mode == "weaver" else None)
    check_pair(
        target.config, drafter.config, weaver.config if weaver is not None else None,
        target_vocab_size=target.get_output_embeddings().weight.shape[0],
        target_embed_dim=target.get_input_embeddings().weight.shape[1],
    )
    _check_eos(target, eos_token_id)
    bound, why = tree_budget_bound(target, input_ids.device)
    if tree_budget != "auto" and tree_budget > bound:
        raise ValueError(f"tree_budget {tree_budget} exceeds max_tree_budget(target, {input_ids.device}) = {bound}: "
                         f"{why}")


def check_room(max_length: int, prompt_length: int) -> None:
    """A prepared ``max_length`` leaves at least one new token after the prompt."""
    if max_length <= prompt_length:
        raise ValueError(f"max_length {max_length} leaves no room after the {prompt_length}-token prompt")


def row_wise(proc) -> bool:
    """Whether a logits processor's output row depends only on that row's logits (:data:`ROW_WISE_PROCESSORS`)."""
    if isinstance(proc, SequenceBiasLogitsProcessor):  # (NoBadWords too) one-token sequences: a fixed bias per row
        seqs = proc.sequence_bias if isinstance(proc.sequence_bias, dict) else [s for s, _ in proc.sequence_bias]
        return all(len(seq) == 1 for seq in seqs)
    return isinstance(proc, ROW_WISE_PROCESSORS)


def check_processors(processors: LogitsProcessorList) -> None:
    """Each processor acts per distribution or per length only; a refused setting's processor raises by the
    setting's name."""
    for proc in processors:
        if row_wise(proc) or isinstance(proc, LENGTH_PROCESSORS):
            continue
        name = type(proc).__name__
        if name in _PROCESSOR_SETTING:
            raise refuse(_PROCESSOR_SETTING[name])
        raise ValueError(
            f"{name} is not supported by tree speculative decoding: only processors that act on each distribution "
            f"independently ({', '.join(p.__name__ for p in ROW_WISE_PROCESSORS)}) or on its length only "
            f"({', '.join(p.__name__ for p in LENGTH_PROCESSORS)}) are"
        )


def check_settings(generation_config, **arguments) -> None:
    """Refuse the settings of :data:`REFUSED` that a prepared ``generation_config`` or ``generate()``'s own
    ``arguments`` carry (processors are checked by :func:`check_processors`)."""
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


def prepare_settings(target, input_ids: torch.Tensor, generation_config, max_new_tokens: int | None, kwargs: dict):
    """``generation_config`` (default: the target's) with ``kwargs`` applied and prepared as ``target.generate``
    prepares it (special-token tensors, lengths), checked, and the processors (checked) and stopping criteria it
    builds from it. Without a length from the arguments or either config, ``max_new_tokens`` is 128."""
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
    check_settings(config)
    target._prepare_special_tokens(config, True, device=input_ids.device, batch_size=1)
    config = target._prepare_generated_length(config, has_default_max_length, has_default_min_length, "input_ids",
                                              input_ids.shape[1], input_ids)
    check_room(config.max_length, input_ids.shape[1])
    processors = target._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(), device=input_ids.device, model_kwargs={},
    )
    check_processors(processors)
    stopping = target._get_stopping_criteria(generation_config=config, stopping_criteria=StoppingCriteriaList())
    return config, processors, stopping
