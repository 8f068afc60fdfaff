# Generated from modeling_weaver/modeling_dflash.py — do not edit; edit the source and run `weaver export`.
"""DFlash block drafter (z-lab layout, docs/DESIGN.md §2).

One forward drafts a block ``[b, MASK × (B-1)]``: Qwen3-style layers, bidirectional among the block tokens, whose
keys/values are the concatenation of projected target context features and the block. The drafter owns no embedding
and no lm_head; callers embed the block with the target's embedding and read logits through the target's lm_head.

Faithfulness notes (checked against z-lab's reference ``dflash/model.py``):

* Context features are ``hidden_norm(fc(cat(target layer outputs)))``, computed **once** per forward and shared by
  every layer. They do *not* go through a layer's ``input_layernorm``; that norm applies to the block stream only.
* Each layer projects context and block with the same ``k_proj`` / ``v_proj``, applies ``k_norm`` to both, then RoPE:
  keys at all positions (context then block), queries (from the block only, after ``q_norm``) at the block positions.
  Rotated keys are what the cache stores.
* Attention is non-causal and unmasked for ``full_attention`` layers. z-lab treats ``sliding_attention`` layers as
  causal inside the block unless the config sets ``is_causal`` explicitly, with a key window of ``sliding_window``;
  we do the same (only some newer checkpoints have such layers).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .configuration_dflash import DFlashConfig


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, D]`` by ``cos, sin [B, T, D]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool (True = attend) or additive float mask → additive float mask in ``dtype``."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


class DFlashAttention(nn.Module):
    """Queries from block tokens; keys/values from ``[context | block]`` with shared projections."""

    cache_attends = True  # forward takes ``attend`` and ``query_key_positions`` (a fixed-shape cache's) as arguments

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

        layer_types = getattr(config, "layer_types", None)
        layer_type = layer_types[layer_idx] if layer_types else "full_attention"
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        explicit = getattr(config, "is_causal", None)
        # z-lab's rule (see module docstring); attention runs non-causal with our mask (or a static cache's kernel).
        self.causal_in_block = layer_type == "sliding_attention" if explicit is None else bool(explicit)
        self.is_causal = False

    def layer_mask(self, num_queries: int, num_keys: int, device, positions=None) -> torch.Tensor | None:
        """``[Q, K]`` bool mask for causal / sliding layers, else ``None``.

        Queries are the last ``Q`` keys, unless ``positions = (query_positions [Q], key_positions [K])`` says where
        each sits (a static cache whose rows are positions).
        """
        if not self.causal_in_block and self.sliding_window is None:
            return None
        if positions is None:
            q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
            k_pos = torch.arange(num_keys, device=device)[None, :]
        else:
            q_pos, k_pos = positions[0][:, None], positions[1][None, :]
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
        if self.causal_in_block:
            visible &= k_pos <= q_pos
        if self.sliding_window is not None:
            visible &= q_pos - k_pos < self.sliding_window
            if not self.causal_in_block:
                visible &= k_pos - q_pos < self.sliding_window
        return visible

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        attend=None,
        query_key_positions: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """
        Args:
            hidden_states: ``[B, S, H]`` normed block stream.
            context: ``[B, C, H]`` projected context features of the new context positions.
            position_embeddings: ``cos, sin [B, C + S, head_dim]``.
            attention_mask: additive or bool ``[B, 1, S, past + C + S]``.
            attend: optional ``attend(layer, q, k, v) → [B, S, heads · head_dim] | None``: runs this layer's
                attention instead (a fixed-shape cache's own kernel); None from it leaves the layer to masked
                attention.
            query_key_positions: ``(query positions [S], key positions [K])`` when cache rows are not in position
                order (a fixed-shape cache whose rows are positions); None: queries are the last keys.
        Returns:
            ``[B, S, H]``
        """
        bsz, q_len, _ = hidden_states.shape
        ctx_len = context.shape[1]
        both = torch.cat([context, hidden_states], dim=1)  # [B, C + S, H]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(bsz, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q = _rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rope(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        out = attend(self, q, k, v) if attend is not None else None
        if out is not None:
            return self.o_proj(out)

        layer_mask = self.layer_mask(q_len, k.shape[2], q.device, query_key_positions)
        if layer_mask is not None:
            layer_mask = _additive_mask(layer_mask, q.dtype)[None, None]
            attention_mask = layer_mask if attention_mask is None else attention_mask + layer_mask

        attn_fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attn_fn(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            is_causal=False,
            **kwargs,
        )
        return self.o_proj(out.reshape(bsz, q_len, -1))


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm Qwen3 layer over the block stream; the context enters only through attention keys/values."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, past_key_values, **kwargs
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    config: DFlashConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DFlashDraftModel) and module.mask_embedding is not None:
            init.normal_(module.mask_embedding, mean=0.0, std=self.config.initializer_range)


class DFlashDraftModel(DFlashPreTrainedModel):
    """DFlash block drafter: ``fc``/``hidden_norm`` over target features, N non-causal layers, final ``norm``.

    State dict: ``fc.weight [H, n·H]``, ``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.*`` (Qwen3 names) and,
    only when ``config.mask_token_id is None``, ``mask_embedding [H]`` — the learned embedding used at MASK positions
    for targets whose vocabulary has no usable mask token.

    Caching: pass a :class:`~transformers.DynamicCache` (built without a config) to keep projected context K/V. Each
    call appends the new context *and* the block K/V; crop back to the context length afterwards with
    :meth:`crop_cache` so block K/V never persist.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        if not config.target_layer_ids:
            raise ValueError("DFlashConfig needs dflash_config.target_layer_ids (or num_target_layers to derive them)")
        self.target_layer_ids = list(config.target_layer_ids)
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if self.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        else:
            self.mask_embedding = None
        self.post_init()

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.LongTensor,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Draft one block (or, with ``attention_mask``, many blocks at once).

        Args:
            noise_embedding: ``[B, S, H]`` target embedding of ``[b, MASK, ...]`` (see :meth:`block_embeddings`).
            target_hidden: ``[B, C, n·H]`` raw concatenated target features of the *new* context positions (C may
                be 0); see :meth:`extract_context_features`.
            position_ids: ``[B, C + S]`` positions of the new context tokens, then of the block tokens.
            past_key_values: cache of projected context K/V; read and appended (context, then block) when given.
            use_cache: accepted for z-lab compatibility; the cache is used whenever it is passed.
            attention_mask: optional additive or bool (True = attend) ``[B, 1, S, past + C + S]``; ``None`` means
                every block query sees every key (the inference case).
            kwargs: handed to every attention layer (``attend``, ``query_key_positions``: see
                :meth:`DFlashAttention.forward`).
        Returns:
            ``[B, S, H]`` final-normed hidden states; feed ``[:, 1:]`` to the target's lm_head for depths 1..S-1.
        """
        if position_ids.shape[-1] != target_hidden.shape[1] + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids covers {position_ids.shape[-1]} positions, expected context {target_hidden.shape[1]} "
                f"+ block {noise_embedding.shape[1]}"
            )
        hidden_states = noise_embedding
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(hidden_states.shape[0], -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        attention_mask = _additive_mask(attention_mask, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, context, position_embeddings, attention_mask, past_key_values, **kwargs
            )
        return self.norm(hidden_states)

    def block_embeddings(self, bonus_token: torch.LongTensor, embed_tokens: nn.Embedding) -> torch.Tensor:
        """``[B] → [B, block_size, H]``: embeddings of ``[b, MASK × (block_size - 1)]``.

        Uses the target embedding of ``mask_token_id`` or, when the config has none, the learned ``mask_embedding``.
        """
        bsz = bonus_token.shape[0]
        if self.mask_embedding is None:
            ids = torch.full((bsz, self.block_size), self.mask_token_id, dtype=torch.long, device=bonus_token.device)
            ids[:, 0] = bonus_token
            return embed_tokens(ids)
        first = embed_tokens(bonus_token)[:, None]  # [B, 1, H]
        masks = self.mask_embedding.to(first.dtype).expand(bsz, self.block_size - 1, -1)
        return torch.cat([first, masks], dim=1)

    def extract_context_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """HF ``output_hidden_states`` tuple (embeddings first) → ``[B, T, n·H]`` concatenated layer outputs."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @staticmethod
    def new_cache() -> DynamicCache:
        """An empty context cache (plain dynamic layers: sliding-window cache layers would drop context)."""
        return DynamicCache()

    @staticmethod
    def crop_cache(cache: Cache, length: int) -> None:
        """Drop cached K/V beyond ``length`` positions (transformers ≥ 5 ``crop`` takes a negative count)."""
        extra = cache.get_seq_length() - length
        if extra < 0:
            raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
        if extra:
            cache.crop(-extra)

    @staticmethod
    def block_attention_mask(anchor_positions: torch.LongTensor, context_len: int, block_size: int) -> torch.Tensor:
        """Training mask for many blocks in one pass (DFlash §4.2 block-sparse attention).

        Lay the blocks out after the full context: ``noise_embedding [B, nb·S, H]`` (block j = clean anchor token +
        MASKs), ``target_hidden [B, C, n·H]`` of the whole sequence, ``position_ids = cat(arange(C), anchor_j +
        arange(S) for j)``. Block j's queries see context positions ``< anchor_j`` and all keys of block j, nothing
        of other blocks.

        Args:
            anchor_positions: ``[B, nb]`` position of each block's anchor token.
        Returns:
            bool ``[B, 1, nb·S, C + nb·S]`` (True = attend).
        """
        bsz, nb = anchor_positions.shape
        device = anchor_positions.device
        n = nb * block_size
        anchors = anchor_positions.repeat_interleave(block_size, dim=1)  # [B, n] anchor of each query
        ctx = torch.arange(context_len, device=device)[None, None, :] < anchors[:, :, None]  # [B, n, C]
        block_of = torch.arange(n, device=device) // block_size
        same = (block_of[:, None] == block_of[None, :]).expand(bsz, n, n)
        return torch.cat([ctx, same], dim=-1)[:, None]


DFlashDraftModel.register_for_auto_class("AutoModel")

__all__ = ["DFlashDraftModel", "DFlashPreTrainedModel"]
