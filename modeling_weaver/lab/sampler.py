"""Batched sampling with static caches and a CUDA-graph decode step, for training-data generation (issue 4).

``model.generate`` on a 135M target is launch-bound on a GPU, far below what the GPU can do. :class:`BatchedSampler`
runs the same target modules (embedding, norms, projections, rotary embedding, MLPs, lm_head) over a left-padded batch
with a preallocated K/V cache, and on CUDA replays one captured graph per decode step (sampling included), checking for
eos every ``check_every`` steps.

Attention-only targets (Llama, Qwen2, Qwen3). Greedy output equals ``model.generate(do_sample=False)``; sampling draws
from ``softmax(logits / T)`` restricted to the top-p nucleus (a different random stream from transformers').
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.functional as F

from ..target import ATTENTION_ONLY, text_config


class BatchedSampler:
    """Continue ``batch_size`` left-padded prompts at once.

    Args:
        model: an attention-only causal LM (``model_type`` in llama / qwen2 / qwen3).
        batch_size: rows per call (shorter batches are padded with copies of the first prompt).
        max_length: prompt width + new tokens capacity of the cache.
        capture: capture the decode step in a CUDA graph (default: on CUDA).
    """

    def __init__(self, model, batch_size: int, max_length: int, capture: bool | None = None):
        if getattr(model.config, "model_type", None) not in ATTENTION_ONLY:
            raise ValueError(f"BatchedSampler supports {ATTENTION_ONLY} targets, not {model.config.model_type!r}")
        config = text_config(model.config)
        self.model, self.decoder = model, model.model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batch_size, self.max_length = batch_size, max_length
        self.capture = self.device.type == "cuda" if capture is None else capture
        attn = self.decoder.layers[0].self_attn
        self.head_dim, self.num_heads = attn.head_dim, config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        shape = (batch_size, self.num_kv_heads, max_length, self.head_dim)
        self.keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.decoder.layers]
        self.values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.decoder.layers]
        # Static inputs of the decode step.
        self.step_t = torch.zeros((), dtype=torch.long, device=self.device)  # cache row written this step
        self.tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # left padding per row
        self.inv_temperature = torch.ones((), device=self.device)
        self.top_p = torch.ones((), device=self.device)
        self.greedy = True
        self._graph = None

    def _forward(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``ids [B, S]`` written at cache rows ``rows [S]`` → last-position logits ``[B, V]``."""
        B, S = ids.shape
        positions = (rows[None] - self.pad[:, None]).clamp(min=0)  # [B, S]
        cols = torch.arange(self.max_length, device=self.device)
        causal = cols[None, None] <= rows[None, :, None]
        mask = causal & (cols[None, None] >= self.pad[:, None, None])  # [B, S, L]
        mask |= cols[None, None] == rows[None, :, None]  # padding queries see themselves: no empty (NaN) rows
        x = self.decoder.embed_tokens(ids)
        rope = self.decoder.rotary_emb(x, positions)
        for layer, keys, values in zip(self.decoder.layers, self.keys, self.values):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, S, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(B, S, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), *rope)
            keys.index_copy_(2, rows, k.to(keys.dtype))
            values.index_copy_(2, rows, v.to(values.dtype))
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=attn.scaling,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.get_output_embeddings()(self.decoder.norm(x[:, -1]))

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() * self.inv_temperature, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > self.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i / Σp — elementwise RNG
        # and an argmax, which a CUDA graph captures plainly.
        race = sorted_probs / torch.empty_like(sorted_probs).exponential_()
        return order.gather(-1, race.argmax(-1, keepdim=True)).squeeze(-1)

    def _decode_step(self) -> torch.Tensor:
        logits = self._forward(self.tokens[:, None], self.step_t[None])
        self.tokens.copy_(self._choose(logits))
        self.step_t += 1
        return self.tokens

    def _capture(self):
        """Capture the decode step. Warm-up and capture run it, so the step counter and tokens are put back (the K/V
        rows they wrote lie ahead and are rewritten before anything attends to them)."""
        from ..decoding.graphs import capture_graph

        try:
            self._graph, _ = capture_graph(self._decode_step, restore=(self.step_t, self.tokens))
        except RuntimeError as err:  # slower, not wrong: say so and go on eagerly
            warnings.warn(f"BatchedSampler: CUDA-graph capture failed ({err}); decoding eagerly", stacklevel=3)
            self.capture = False

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, eos_token_id, temperature: float = 0.0, top_p: float = 1.0,
                 check_every: int = 16) -> list[tuple[list[int], bool]]:
        """Continue each prompt (token id lists, at most ``batch_size``); returns per prompt ``(new tokens up to and
        including the first eos, finished)``, like :func:`modeling_weaver.lab.data.batched_generate`."""
        if not 0 < len(prompts) <= self.batch_size:
            raise ValueError(f"give 1..{self.batch_size} prompts, got {len(prompts)}")
        width = max(len(p) for p in prompts)
        if width + max_new_tokens > self.max_length:
            raise ValueError(f"{width} prompt + {max_new_tokens} new tokens exceed max_length {self.max_length}")
        eos = torch.tensor(sorted(set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)),
                           device=self.device)
        rows = list(prompts) + [prompts[0]] * (self.batch_size - len(prompts))
        ids = torch.zeros(self.batch_size, width, dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
        self.pad.copy_(torch.tensor([width - len(p) for p in rows]))
        mode = temperature <= 0
        if mode != self.greedy:
            self.greedy, self._graph = mode, None  # the step's code differs: capture again
        self.inv_temperature.fill_(1.0 / temperature if temperature > 0 else 1.0)
        self.top_p.fill_(top_p)

        logits = self._forward(ids.to(self.device), torch.arange(width, device=self.device))
        self.tokens.copy_(self._choose(logits))
        self.step_t.fill_(width)
        out = [self.tokens.clone()]
        done = torch.isin(self.tokens, eos)
        for step in range(1, max_new_tokens):
            if step % check_every == 0 and bool(done.all()):
                break
            if self.capture and self._graph is None:
                self._capture()
            if self.capture:
                self._graph.replay()
            else:
                self._decode_step()
            out.append(self.tokens.clone())
            done |= torch.isin(self.tokens, eos)
        new = torch.stack(out, dim=1)[: len(prompts)].tolist()
        eos_set = set(eos.tolist())
        results = []
        for row in new:
            cut = next((i for i, t in enumerate(row) if t in eos_set), None)
            results.append((row if cut is None else row[: cut + 1], cut is not None))
        return results


__all__ = ["BatchedSampler"]
