# Generated from modeling_weaver/modeling_weaver.py — do not edit; edit the source and run `weaver export`.
"""Weaver tree adapter (paper's released layout, docs/DESIGN.md §3).

Weaver turns DFlash's per-depth marginals into path-conditioned proposals. Per speculative step:

1. :meth:`WeaverModel.encode_prompt` runs the blocks causally over ``P = 1 + depth`` prompt entries (the target's final
   hidden state at the last committed position, then DFlash's hidden states at block positions 1..depth) and keeps
   each layer's K/V: the "external" KV every node step attends to.
2. Tree nodes are expanded in batches with :meth:`WeaverModel.step`: a node at depth d (root 0) has input
   ``token_in(embed_norm(E_target[token]))`` at RoPE position d + 1 and attends to the whole prompt, its ancestors and
   itself through a per-layer node cache.
3. :meth:`WeaverModel.candidate_logits` scores a node's children among the top-pool DFlash tokens of depth d + 1:
   ``dflash_logit + E_lm[c] · query`` — only the pool rows of the target lm_head are read (the tree build runs the
   same formula as the ``weaver_kernels.pool_scores`` op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import PreTrainedModel

from .configuration_weaver import WeaverConfig


@dataclass
class WeaverPrompt:
    """Per-layer prompt K/V, each ``[B, heads, P, head_dim]`` (RoPE applied at positions 0..P-1)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


@dataclass
class WeaverNodeCache:
    """Per-layer K/V slots of tree nodes, each ``[B, heads, max_nodes, head_dim]``; a node owns one slot."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def max_nodes(self) -> int:
        return self.keys[0].shape[2]


class WeaverRMSNorm(nn.Module):
    """RMSNorm with a bias, computed in fp32: ``x / rms(x) * weight + bias``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float() + self.bias.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class WeaverBlock(nn.Module):
    """Pre-norm block: attention (q, k, v stacked in one projection, RoPE on q/k) then a SwiGLU MLP."""

    def __init__(self, config: WeaverConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.d_rank // config.num_heads
        self.rope_base = config.rope_base
        self.norm_attn = WeaverRMSNorm(config.d_rank, config.norm_eps)
        self.qkv_proj = nn.Linear(config.d_rank, 3 * config.d_rank, bias=False)
        self.o_proj = nn.Linear(config.d_rank, config.d_rank, bias=False)
        self.norm_mlp = WeaverRMSNorm(config.d_rank, config.norm_eps)
        self.gate_up_proj = nn.Linear(config.d_rank, 2 * config.mlp_dim)
        self.down_proj = nn.Linear(config.mlp_dim, config.d_rank)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, d_rank]``, ``positions [B, T]`` → q, k, v ``[B, heads, T, head_dim]`` (q, k rotated)."""
        bsz, t, _ = x.shape
        # Weight rows are [q | k | v], each head-major.
        q, k, v = self.qkv_proj(self.norm_attn(x)).view(bsz, t, 3, self.num_heads, self.head_dim).unbind(2)
        inv_freq = self.rope_base ** (
            -torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=x.device) / self.head_dim
        )
        angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
        q, k, v = (t_.transpose(1, 2) for t_ in (q, k, v))
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return q, k, v

    def finish(
        self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of ``q`` over ``keys/values [B, heads, L, head_dim]`` with bool ``mask [B, 1, T, L]``, + MLP."""
        bsz, t, d = x.shape
        attn = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
        return self.feed_forward(x, attn.transpose(1, 2).reshape(bsz, t, d))

    def feed_forward(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual output projection of the heads' outputs ``attn [B, T, d_rank]``, then the MLP."""
        x = x + self.o_proj(attn)
        gate, up = self.gate_up_proj(self.norm_mlp(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class WeaverPreTrainedModel(PreTrainedModel):
    config_class = WeaverConfig
    config: WeaverConfig
    base_model_prefix = "weaver"
    _no_split_modules = ["WeaverBlock"]


class WeaverModel(WeaverPreTrainedModel):
    """Weaver adapter. Keys: ``output_norm``, ``embed_norm``, ``token_in``, ``proposal_in``, ``blocks.{i}.*``,
    ``out_norm``, ``lm_head_query_in`` (shapes: docs/DESIGN.md §3). Owns no embedding and no lm_head: node inputs
    are target embeddings and candidate scores read rows of the target lm_head."""

    def __init__(self, config: WeaverConfig):
        super().__init__(config)
        self.output_norm = WeaverRMSNorm(config.d_model, config.norm_eps)
        self.embed_norm = WeaverRMSNorm(config.d_embed, config.norm_eps)
        self.token_in = nn.Linear(config.d_embed, config.d_rank)
        self.proposal_in = nn.Linear(config.d_model, config.d_rank)
        self.blocks = nn.ModuleList([WeaverBlock(config) for _ in range(config.num_layers)])
        self.out_norm = WeaverRMSNorm(config.d_rank, config.norm_eps)
        self.lm_head_query_in = nn.Linear(config.d_rank, config.d_model, bias=False)
        self.post_init()

    # -- per-step API -------------------------------------------------------------------------------------------------

    def encode_prompt(self, target_hidden: torch.Tensor, draft_hidden: torch.Tensor) -> WeaverPrompt:
        """Build the prompt K/V of one speculative step.

        Args:
            target_hidden: ``[B, d_model]`` target final hidden state at the last committed position (the row whose
                logits gave the bonus token).
            draft_hidden: ``[B, depth, d_model]`` DFlash output hidden states at block positions 1..depth; only the
                first ``K`` are used.
        Returns:
            :class:`WeaverPrompt` with ``P = 1 + min(depth, K)`` entries per layer.
        """
        feats = torch.cat([target_hidden[:, None], draft_hidden[:, : self.config.K]], dim=1)
        x = self.proposal_in(self.output_norm(feats.to(self.proposal_in.weight.dtype)))  # [B, P, d_rank]
        bsz, p, _ = x.shape
        positions = torch.arange(p, device=x.device)[None].expand(bsz, p)
        causal = torch.ones(p, p, dtype=torch.bool, device=x.device).tril()[None, None]
        keys, values = [], []
        for i, block in enumerate(self.blocks):
            q, k, v = block.qkv(x, positions)
            keys.append(k)
            values.append(v)
            if i + 1 < len(self.blocks):  # the last block's outputs are never read
                x = block.finish(x, q, k, v, causal)
        return WeaverPrompt(keys, values)

    def new_node_cache(
        self, max_nodes: int, batch_size: int = 1, device=None, dtype: torch.dtype | None = None
    ) -> WeaverNodeCache:
        """Zeroed per-layer K/V slots ``[batch_size, heads, max_nodes, head_dim]`` for the nodes of a tree."""
        device = device if device is not None else self.device
        dtype = dtype if dtype is not None else self.dtype
        shape = (batch_size, self.config.num_heads, max_nodes, self.config.head_dim)
        return WeaverNodeCache(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in self.blocks],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in self.blocks],
        )

    def node_inputs(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """``[..., d_embed] → [..., d_rank]``: ``token_in(embed_norm(e))``. Per-token, so it can be precomputed over
        the whole target embedding table."""
        return self.token_in(self.embed_norm(token_embeds.to(self.token_in.weight.dtype)))

    @torch.no_grad()
    def node_input_table(self, embed_weight: torch.Tensor, rows_per_pass: int = 16384) -> torch.Tensor:
        """:meth:`node_inputs` of every row of the target embedding ``embed_weight [V, d_embed]`` → ``[V, d_rank]``:
        a node's input is then one row gather instead of a norm and a ``d_embed × d_rank`` matmul per expansion round
        (1 GB in bf16 at Qwen3.6-27B shape, V = 248k, d_rank 2048). Recompute it after changing the weights."""
        return torch.cat([self.node_inputs(embed_weight[i : i + rows_per_pass])
                          for i in range(0, embed_weight.shape[0], rows_per_pass)])

    def step(
        self,
        prompt: WeaverPrompt,
        cache: WeaverNodeCache,
        x: torch.Tensor,
        depths: torch.Tensor,
        slots: torch.Tensor | slice,
        mask: torch.Tensor,
        attend: Callable | None = None,
    ) -> torch.Tensor:
        """Run ``M`` tree nodes through the blocks together.

        Each node first writes its K/V into its slot of every layer, then attends to all prompt entries and to the
        node slots allowed by ``mask`` (ancestors-or-self), so nodes of one call may be each other's ancestors (a
        chain in one call is teacher forcing) and siblings never see each other.

        Args:
            prompt: from :meth:`encode_prompt` (batch 1 broadcasts).
            cache: from :meth:`new_node_cache`; written in place.
            x: ``[B, M, d_rank]`` node inputs (:meth:`node_inputs`).
            depths: ``[B, M]`` node depths (root 0); RoPE position ``depth + 1``.
            slots: ``[B, M]`` node-cache slot of each node, or a ``slice`` of ``M`` consecutive slots shared by
                the batch (written with a plain copy instead of a scatter).
            mask: ``[B, M, max_nodes]`` bool, True where the node may attend (its ancestors and itself).
            attend: optional, batch 1 and slot ranges only: ``attend(layer, qkv [M, 3·d_rank], positions [M], lo,
                mask [M, max_nodes]) → [M, d_rank]`` does a layer's RoPE, slot writes (into ``cache``) and attention
                in one call, over the prompt it was made for (the tree build binds ``weaver_kernels.node_attention``
                to its step's prompt and cache); without it the blocks run them as torch ops.
        Returns:
            ``[B, M, d_model]`` lm-head queries ``lm_head_query_in(out_norm(h))``.
        """
        bsz, m = depths.shape
        positions = depths + 1
        if attend is not None and bsz == 1 and isinstance(slots, slice):
            for i, block in enumerate(self.blocks):
                attn = attend(i, block.qkv_proj(block.norm_attn(x))[0], positions[0], slots.start, mask[0])
                x = block.feed_forward(x, attn[None])
            return self.lm_head_query_in(self.out_norm(x))
        prompt_visible = torch.ones(bsz, m, prompt.length, dtype=torch.bool, device=x.device)
        full_mask = torch.cat([prompt_visible, mask.to(torch.bool)], dim=-1)[:, None]  # [B, 1, M, P + max_nodes]
        for i, block in enumerate(self.blocks):
            q, k, v = block.qkv(x, positions)
            node_k, node_v = cache.keys[i], cache.values[i]
            if isinstance(slots, slice):
                node_k[:, :, slots] = k.to(node_k.dtype)
                node_v[:, :, slots] = v.to(node_v.dtype)
            else:
                rows = torch.arange(bsz, device=x.device)[:, None].expand(bsz, m)
                # Advanced indices around a slice put [B, M] first: the target is [B, M, heads, head_dim].
                node_k[rows, :, slots] = k.transpose(1, 2).to(node_k.dtype)
                node_v[rows, :, slots] = v.transpose(1, 2).to(node_v.dtype)
            keys = torch.cat([prompt.keys[i].expand(bsz, -1, -1, -1).to(q.dtype), node_k.to(q.dtype)], dim=2)
            values = torch.cat([prompt.values[i].expand(bsz, -1, -1, -1).to(q.dtype), node_v.to(q.dtype)], dim=2)
            x = block.finish(x, q, keys, values, full_mask)
        return self.lm_head_query_in(self.out_norm(x))

    @staticmethod
    def candidate_logits(
        query: torch.Tensor, pool_ids: torch.Tensor, pool_logits: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> torch.Tensor:
        """Weaver logits of the candidate pool, fp32.

        Args:
            query: ``[..., d_model]`` from :meth:`step`.
            pool_ids: ``[..., pool]`` candidate token ids (top-pool DFlash tokens at the children's depth).
            pool_logits: ``[..., pool]`` their DFlash logits.
            lm_head_weight: ``[V, d_model]`` target lm_head; only the ``pool_ids`` rows are gathered.
        Returns:
            ``[..., pool]`` = ``pool_logits + lm_head_weight[pool_ids] · query``.
        """
        rows = lm_head_weight[pool_ids]  # [..., pool, d_model]
        residual = torch.matmul(rows, query.to(rows.dtype).unsqueeze(-1)).squeeze(-1)
        return pool_logits.float() + residual.float()

    # -- teacher forcing ----------------------------------------------------------------------------------------------

    def forward(
        self, target_hidden: torch.Tensor, draft_hidden: torch.Tensor, token_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced chain: nodes ``0..T-1`` at depths ``0..T-1``, each the child of the previous one.

        Args:
            target_hidden: ``[B, d_model]``; draft_hidden: ``[B, depth, d_model]`` (as in :meth:`encode_prompt`).
            token_embeds: ``[B, T, d_embed]`` target embeddings of the path tokens, root (bonus token) first.
        Returns:
            ``[B, T, d_model]`` queries; node t scores the candidates for depth t + 1.
        """
        bsz, t, _ = token_embeds.shape
        prompt = self.encode_prompt(target_hidden, draft_hidden)
        cache = self.new_node_cache(t, batch_size=bsz, device=token_embeds.device, dtype=self.proposal_in.weight.dtype)
        depths = torch.arange(t, device=token_embeds.device)[None].expand(bsz, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=token_embeds.device).tril()[None].expand(bsz, t, t)
        return self.step(prompt, cache, self.node_inputs(token_embeds), depths, depths, causal)

    # -- released checkpoint ------------------------------------------------------------------------------------------

    @classmethod
    def from_released_checkpoint(cls, path, dtype=None) -> WeaverModel:
        """Load the paper's ``.pth`` payload ``{"config": {...}, "state_dict": {...}}`` (strict keys)."""
        # The converter (field-by-field config mapping, key/shape checks) lives in the package, not in this
        # self-contained Hub code file; the import sits in a try so transformers does not demand it on Hub loading.
        try:
            from modeling_weaver.convert import load_released_weaver
        except ImportError as err:
            raise ImportError("from_released_checkpoint needs the modeling-weaver package") from err
        return load_released_weaver(path, dtype=dtype)


WeaverModel.register_for_auto_class("AutoModel")

__all__ = ["WeaverModel", "WeaverPreTrainedModel", "WeaverPrompt", "WeaverNodeCache"]
