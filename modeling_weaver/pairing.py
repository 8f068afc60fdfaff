"""Does a drafter pair fit a target? One check shared by the decoding loop, the exporter and the CLI."""

from __future__ import annotations

from .target import text_config as _text

__all__ = ["PairingError", "check_pair"]


class PairingError(ValueError):
    """A drafter (or Weaver) does not fit the target it is paired with."""


def _config(obj):
    return getattr(obj, "config", obj)


def check_pair(target_config, dflash_config, weaver_config=None, *, target_vocab_size: int | None = None,
               target_embed_dim: int | None = None) -> None:
    """Refuse a DFlash drafter / Weaver that was not built for this target, with the reason.

    Accepts configs or models (their ``.config``); multimodal target configs are reduced to their text part.
    ``target_vocab_size`` / ``target_embed_dim`` override the config's figures with the real lm_head rows / embedding
    width of a loaded target (they can differ from ``vocab_size`` when a checkpoint pads its tables).

    Checks: drafter ``hidden_size`` and ``vocab_size``; ``target_layer_ids`` exist in the target and, when the drafter
    records ``num_target_layers``, the depth matches; ``mask_token_id`` is in the vocabulary; Weaver ``d_model`` /
    ``d_embed`` match the target's hidden size / embedding width and its candidate pool fits the vocabulary.
    """
    target = _text(_config(target_config))
    dflash = _config(dflash_config)
    hidden, layers = target.hidden_size, target.num_hidden_layers
    vocab = target_vocab_size if target_vocab_size is not None else target.vocab_size
    embed_dim = target_embed_dim
    if embed_dim is None:
        embed_dim = getattr(target, "embedding_size", None) or hidden

    if dflash.hidden_size != hidden:
        raise PairingError(f"drafter hidden_size {dflash.hidden_size} does not match the target's {hidden}: it reads "
                           "the target's embeddings and feeds the target's lm_head")
    if dflash.vocab_size != vocab:
        raise PairingError(f"drafter vocab_size {dflash.vocab_size} does not match the target's lm_head ({vocab})")
    ids = list(dflash.target_layer_ids or [])
    if not ids:
        raise PairingError("drafter has no target_layer_ids (dflash_config.target_layer_ids)")
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise PairingError(f"drafter target_layer_ids {bad} do not exist in the target ({layers} layers)")
    built_for = getattr(dflash, "num_target_layers", None)
    if built_for is not None and built_for != layers:
        raise PairingError(f"drafter was built for a {built_for}-layer target (num_target_layers), this target has "
                           f"{layers} layers")
    mask = dflash.mask_token_id
    if mask is not None and not 0 <= mask < vocab:
        raise PairingError(f"drafter mask_token_id {mask} is outside the target vocabulary (size {vocab})")
    if weaver_config is None:
        return
    weaver = _config(weaver_config)
    if weaver.d_model != hidden:
        raise PairingError(f"weaver d_model {weaver.d_model} does not match the target's hidden size {hidden}")
    if weaver.d_embed != embed_dim:
        raise PairingError(f"weaver d_embed {weaver.d_embed} does not match the target's embedding width {embed_dim}")
    if weaver.candidate_pool_size > vocab:
        raise PairingError(f"weaver candidate_pool_size {weaver.candidate_pool_size} exceeds the target vocabulary "
                           f"({vocab})")
