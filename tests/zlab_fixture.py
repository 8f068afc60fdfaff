"""Synthetic z-lab DFlash checkpoints: their config.json fields and spellings, their safetensors keys, any size."""

from __future__ import annotations

import torch


def zlab_config(*, hidden, heads, kv_heads, head_dim, ffn, layers, block, vocab, mask_token_id, target_layer_ids,
                num_target_layers, **changes) -> dict:
    """A z-lab DFlash ``config.json`` (``model_type "qwen3"``, ``dflash_config``, their ``auto_map``)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        "dtype": "bfloat16",
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": ffn,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    config.update(changes)
    return config


def zlab_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Their safetensors keys for ``config`` (no embed_tokens, no lm_head), bf16, norms near 1."""
    h, hd, ffn = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    n_features = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (h, n_features * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                   p + "mlp.down_proj.weight": (h, ffn)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        out[key] = (1 + 0.1 * noise if len(shape) == 1 else noise / shape[-1] ** 0.5).to(torch.bfloat16)
    return out
