# Generated from modeling_weaver/configuration_weaver.py — do not edit; edit the source and run `weaver export`.
"""Weaver tree adapter configuration (paper's released layout, docs/DESIGN.md §3)."""

from __future__ import annotations

import math

from transformers import PreTrainedConfig


def _text_config(config):
    text = getattr(config, "text_config", None)
    return text if text is not None else config


def _default_num_heads(d_rank: int, head_dim: int = 128) -> int:
    """Most heads of at most ``head_dim`` width that split ``d_rank`` into equal, even head dims."""
    for heads in range(max(1, d_rank // head_dim), d_rank + 1):
        if d_rank % heads == 0 and (d_rank // heads) % 2 == 0:
            return heads
    raise ValueError(f"d_rank {d_rank} cannot be split into heads of even width (RoPE needs even head dims)")


#: ``config.json`` fields that fix the Weaver's tensor shapes: a file must state them (checked on load).
#: ``candidate_pool_size`` of :meth:`WeaverConfig.from_target_config` when the vocabulary is at least this large.
DEFAULT_CANDIDATE_POOL_SIZE = 512
SHAPE_FIELDS = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K", "candidate_pool_size")


class WeaverConfig(PreTrainedConfig):
    r"""Configuration of a :class:`~modeling_weaver.modeling_weaver.WeaverModel`.

    Args:
        d_model (`int`): target hidden size (width of the prompt features and of the target lm_head rows).
        d_embed (`int`): target input-embedding width (node inputs are target token embeddings).
        d_rank (`int`): Weaver's own width.
        num_layers (`int`, defaults to 1): pre-norm transformer blocks.
        num_heads (`int`): attention heads; ``d_rank / num_heads`` must be even (RoPE).
        mlp_dim (`int`): SwiGLU hidden width.
        K (`int`): maximum node depth handled; at least ``block_size - 1`` of the paired DFlash drafter.
        candidate_pool_size (`int`, defaults to 512): children of a node are scored among the top-pool DFlash tokens.
        rope_base (`float`, defaults to 1e4): RoPE base of the blocks.
        norm_eps (`float`, defaults to 1e-6): eps of the (fp32, biased) RMSNorms.
    """

    model_type = "weaver"

    d_model: int = 5120
    d_embed: int = 5120
    d_rank: int = 2048
    num_layers: int = 1
    num_heads: int = 16
    mlp_dim: int = 1368
    K: int = 15
    candidate_pool_size: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.d_rank % self.num_heads:
            raise ValueError(f"d_rank ({self.d_rank}) must be divisible by num_heads ({self.num_heads})")
        if (self.d_rank // self.num_heads) % 2:
            raise ValueError(f"head dim d_rank / num_heads = {self.d_rank // self.num_heads} must be even for RoPE")
        for name in ("d_model", "d_embed", "d_rank", "num_layers", "mlp_dim", "K", "candidate_pool_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.rope_base <= 0:
            raise ValueError(f"rope_base must be positive, got {self.rope_base}")

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        config_dict, kwargs = super().get_config_dict(*args, **kwargs)
        # a missing field would load as the 27B default (d_model 5120, ...): name the file and the field instead
        where = f"{args[0]}/config.json" if args else "config.json"
        for name in SHAPE_FIELDS:
            value = config_dict.get(name)
            if value is None:
                raise ValueError(f"{where}: required field '{name}' is missing")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: field '{name}' must be a positive integer, got {value!r}")
        return config_dict, kwargs

    @property
    def head_dim(self) -> int:
        return self.d_rank // self.num_heads

    @classmethod
    def from_target_config(
        cls,
        target_config,
        dflash_config,
        d_rank: int | None = None,
        num_layers: int = 1,
        num_heads: int | None = None,
        mlp_dim: int | None = None,
        candidate_pool_size: int | None = None,
        **overrides,
    ) -> WeaverConfig:
        """A Weaver config for a target and its DFlash drafter.

        ``d_model`` and ``d_embed`` come from the target (``d_embed`` = its embedding width, the hidden size for all
        supported families), ``K = dflash.block_size - 1``. Defaults: ``d_rank = min(2048, d_model)``; heads of width
        ≤ 128 (16 at d_rank 2048); ``mlp_dim ≈ 2/3 · d_rank`` rounded up to a multiple of 8 (1368 at d_rank 2048);
        ``candidate_pool_size = min(512, vocabulary)`` (a larger one given raises: it must fit the vocabulary).
        The paper does not state heads / mlp_dim; this mlp_dim reproduces its 56.7 M parameters at the 27B shape
        (one layer, d_rank 2048) — the attention head count does not change the parameter count.
        """
        text = _text_config(target_config)
        d_model = text.hidden_size
        if dflash_config.hidden_size != d_model:
            raise ValueError(
                f"target hidden size {d_model} != DFlash hidden size {dflash_config.hidden_size}: the drafter was "
                "built for another target"
            )
        if getattr(dflash_config, "vocab_size", None) not in (None, text.vocab_size):
            raise ValueError(f"target vocab {text.vocab_size} != DFlash vocab {dflash_config.vocab_size}")
        num_target = getattr(dflash_config, "num_target_layers", None)
        if num_target is not None and num_target != text.num_hidden_layers:
            raise ValueError(
                f"DFlash drafter expects a {num_target}-layer target, this target has {text.num_hidden_layers} layers"
            )
        vocab = getattr(dflash_config, "vocab_size", None) or text.vocab_size
        if candidate_pool_size is None:  # the pool is drawn from the vocabulary: never more than it holds
            candidate_pool_size = min(DEFAULT_CANDIDATE_POOL_SIZE, vocab)
        elif candidate_pool_size > vocab:
            raise ValueError(f"candidate_pool_size {candidate_pool_size} exceeds the target vocabulary ({vocab}); "
                             f"give at most {vocab} (or leave it unset: min({DEFAULT_CANDIDATE_POOL_SIZE}, vocab))")
        d_rank = min(2048, d_model) if d_rank is None else d_rank
        if num_heads is None:
            num_heads = _default_num_heads(d_rank)
        if mlp_dim is None:
            mlp_dim = 8 * math.ceil(math.ceil(2 * d_rank / 3) / 8)
        fields = dict(
            d_model=d_model,
            d_embed=getattr(text, "embedding_size", None) or d_model,
            d_rank=d_rank,
            num_layers=num_layers,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            K=dflash_config.block_size - 1,
            candidate_pool_size=candidate_pool_size,
        )
        fields.update(overrides)
        if fields["K"] < dflash_config.block_size - 1:
            raise ValueError(f"K ({fields['K']}) must cover the drafter's depths 1..{dflash_config.block_size - 1}")
        return cls(**fields)


WeaverConfig.register_for_auto_class("AutoConfig")

__all__ = ["WeaverConfig"]
