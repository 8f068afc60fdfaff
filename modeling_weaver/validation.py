"""Input checks at the API boundary (``speculative_generate`` / ``generate``), run once per call before any work.

Each bad input gets a ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value) whose message
names the argument and says what is allowed, instead of an error from deep inside torch or transformers.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["check_attention_mask", "check_call", "caller_streamer"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _vocab_size(target) -> int:
    return target.get_input_embeddings().weight.shape[0]


def _check_input_ids(target, input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor):
        return  # (the prompt check names what a prompt must be)
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long, as a tokenizer returns them), got dtype "
                        f"{input_ids.dtype}")
    if input_ids.numel() == 0:
        return
    vocab = _vocab_size(target)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids holds token id {bad}, outside the target's vocabulary: ids must be in "
                         f"[0, {vocab - 1}]")


_WANTED = {"target": "transformers causal LM", "dflash": "DFlashDraftModel", "weaver": "WeaverModel"}
_SLOT = {"dflash": "drafter", "weaver": "weaver"}


def _check_model(name: str, model, expected: str) -> None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind in _SLOT and kind != expected:
        swapped = " (drafter and weaver swapped?)" if expected in _SLOT else ""
        raise TypeError(f"{name}= got a {type(model).__name__} (model_type {kind!r}): {name}= takes a "
                        f"{_WANTED[expected]}; this one belongs in {_SLOT[kind]}={swapped}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name}= must be a loaded {_WANTED[expected]} (a torch module), got {type(model).__name__}")
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"{name}= has parameters on the meta device (e.g. '{meta}'): its weights were never loaded. "
                         "Load it with from_pretrained (without device_map='meta' / init_empty_weights) or "
                         "load_state_dict(..., assign=True) first")


def _check_eos(target, eos_token_id) -> None:
    if eos_token_id is None:
        return
    ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if isinstance(eos_token_id, torch.Tensor):
        ids = eos_token_id.flatten().tolist() if not eos_token_id.is_floating_point() else [eos_token_id]
    if not all(_is_int(i) for i in ids):  # ([]: no eos at all, the target's overridden)
        raise TypeError(f"eos_token_id must be a token id (int) or a list of them, got {eos_token_id!r}")
    vocab = _vocab_size(target)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} is outside the target's vocabulary: ids must be in [0, {vocab - 1}]")


def check_call(target, input_ids, *, drafter, weaver, tree_budget, do_sample=False, temperature=1.0,
               eos_token_id=None) -> None:
    """What the existing prompt / argument checks of :mod:`modeling_weaver.generate` do not cover: token id dtypes
    and range, ``tree_budget`` given as a bool, ``do_sample`` / ``temperature`` kinds, models in the wrong slot or not
    loaded (meta device), and the type and range of ``eos_token_id``."""
    _check_model("target", target, "target")
    _check_input_ids(target, input_ids)
    if tree_budget != "auto" and not _is_int(tree_budget):
        raise TypeError(f'tree_budget counts draft nodes and must be an int >= 1 or "auto", got {tree_budget!r}')
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if do_sample and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
        raise TypeError(f"temperature must be a number > 0 when do_sample=True, got {temperature!r}")
    if drafter is not None:
        _check_model("drafter", drafter, "dflash")
    if weaver is not None:
        _check_model("weaver", weaver, "weaver")
    _check_eos(target, eos_token_id)


def check_attention_mask(input_ids, attention_mask) -> None:
    """``attention_mask`` as a tokenizer returns it (``speculative_generate(target, **tokenizer(text, ...))``):
    accepted when it masks nothing; a padded prompt is refused (batch size 1, no padding)."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor like input_ids, got {type(attention_mask).__name__}")
    if isinstance(input_ids, torch.Tensor) and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}, input_ids "
                         f"{list(input_ids.shape)}: they must match")
    if not bool((attention_mask == 1).all()):
        raise ValueError("attention_mask masks some prompt tokens: padded prompts are not supported by tree "
                         "speculative decoding (batch size 1, no padding); pass the unpadded prompt, or a mask of "
                         "all ones")


def caller_streamer():
    """The ``streamer=`` given to ``target.generate(..., custom_generate=<callable>, streamer=...)``.

    transformers keeps that argument for itself with a callable ``custom_generate``: it sends the prompt to it and
    never passes it on. It is still a local of transformers' ``generate`` frame, where this finds it (None when not
    called from there)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        if (frame.f_code.co_name == "generate" and frame.f_globals.get("__name__") == "transformers.generation.utils"
                and "streamer" in frame.f_locals and "custom_generate" in frame.f_locals):
            return frame.f_locals["streamer"]
        frame = frame.f_back
    return None


def load_dict_file(file, what: str, fields, map_location="cpu") -> dict:
    """A ``torch.save``d dict read without executing code (``weights_only=True``: a pickle that names any callable
    is refused); errors name the file and what it should have been. The caller checks the fields."""
    try:
        obj = torch.load(file, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - pickles that need code, truncated or foreign files, ...
        raise ValueError(f"{file}: not {what} ({type(err).__name__}: {' '.join(str(err).split())[:300]})") from err
    if not isinstance(obj, dict):
        raise ValueError(f"{file}: expected a dict of {', '.join(fields)}, found {type(obj).__name__}")
    return obj
