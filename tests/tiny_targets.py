"""Tiny random transformers targets shared by the tests (fp32, CPU, eager attention)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    KimiLinearConfig,
    KimiLinearForCausalLM,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

VOCAB = 97


def tiny_llama(seed: int = 0, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def tiny_qwen3(seed: int = 0, vocab: int = VOCAB) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
        # with tied embeddings and small weights the residual stream wins and greedy repeats one token forever
        initializer_range=0.2,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_qwen3_5(seed: int = 0, vocab: int = VOCAB) -> Qwen3_5ForCausalLM:
    """Hybrid target: 2 Gated DeltaNet layers then 1 gated full-attention layer, twice (grouped GDN heads)."""
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    model = Qwen3_5ForCausalLM(config).eval()
    # Random init leaves RMSNorm weights at zero-centred 0 and small weights; spread the logits a little so greedy
    # argmax is not decided by float noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def tiny_qwen3_moe(seed: int = 0, vocab: int = VOCAB) -> Qwen3MoeForCausalLM:
    """Attention + MoE: 4 experts, top-2 routing, in layers 0 and 2; layer 1 a dense MLP (``mlp_only_layers``)."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )
    return Qwen3MoeForCausalLM(config).eval()


# Hybrid GDN + MoE: 2 key / 4 value GDN heads with key dim != value dim (a mixed-up head layout changes the outputs),
# 4 experts top-2 plus a gated shared expert, gated attention with partial rotary (4 of 16 dims rotated).
_HYBRID_MOE = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, max_position_embeddings=512, tie_word_embeddings=False,
    eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def _spread_logits(model):
    # zero-centred norms and small weights leave the logits close together: greedy argmax would be float noise
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def tiny_qwen3_5_moe(seed: int = 0, vocab: int = VOCAB) -> Qwen3_5MoeForCausalLM:
    """Qwen3.5-MoE: every layer's MLP a MoE block; separate GDN projections; multimodal (3-grid) RoPE."""
    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**{**_HYBRID_MOE, "vocab_size": vocab})
    return _spread_logits(Qwen3_5MoeForCausalLM(config).eval())


def tiny_qwen3_next(seed: int = 0, vocab: int = VOCAB) -> Qwen3NextForCausalLM:
    """Qwen3-Next: fused per-key-head GDN projections (in_proj_qkvz / in_proj_ba), 1-D RoPE; layer 1 a dense MLP."""
    torch.manual_seed(seed)
    config = Qwen3NextConfig(**{**_HYBRID_MOE, "vocab_size": vocab}, intermediate_size=64, decoder_sparse_step=1,
                             mlp_only_layers=[1], norm_topk_prob=True)
    return _spread_logits(Qwen3NextForCausalLM(config).eval())




# sliding windows shorter than the tests' prompts (up to 40 tokens) and generations: the window cuts
WINDOW = 8


def tiny_mistral(seed: int = 0, vocab: int = VOCAB, sliding_window: int | None = WINDOW) -> MistralForCausalLM:
    """Every layer on a sliding window of ``sliding_window`` tokens (None: full attention, the same weights)."""
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=sliding_window, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )
    return MistralForCausalLM(config).eval()


def tiny_gemma3(seed: int = 0, vocab: int = VOCAB, sliding_window: int | None = WINDOW) -> Gemma3ForCausalLM:
    """Sliding, full, sliding layers (local and global RoPE bases), sandwich norms, a query scalar other than the head
    dim, final logit softcapping (``sliding_window=None``: every layer full, the same weights)."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16, sliding_window=sliding_window or 512,
        layer_types=["sliding_attention" if sliding_window else "full_attention", "full_attention",
                     "sliding_attention" if sliding_window else "full_attention"],
        final_logit_softcapping=3.0, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, initializer_range=0.2,
        # tied to the sqrt(hidden)-scaled embedding the residual stream wins and greedy repeats one token forever
        tie_word_embeddings=False,
    )
    return Gemma3ForCausalLM(config).eval()


def tiny_gpt_oss(seed: int = 0, vocab: int = VOCAB, sliding_window: int | None = WINDOW) -> GptOssForCausalLM:
    """Sliding, full, sliding layers with attention sinks (large enough to matter); MoE of 4 experts, top-2, in every
    layer (``sliding_window=None``: every layer full, the same weights)."""
    torch.manual_seed(seed)
    config = GptOssConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=sliding_window or 512,
        layer_types=["sliding_attention" if sliding_window else "full_attention", "full_attention",
                     "sliding_attention" if sliding_window else "full_attention"],
        max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, initializer_range=0.2,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0},
    )
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 2)
    return model


def tiny_kimi_linear(seed: int = 0, vocab: int = VOCAB) -> KimiLinearForCausalLM:
    """Kimi Linear: KDA, KDA, MLA, KDA layers (4 heads of 8 per-channel-gated dims; latent attention with rank 16, nope
    8, shared rope-part 4 and value 12 dims, all different so that a mixed-up split shows); layer 0 a dense MLP, the
    others MoE blocks of 4 experts top-2 in 2 groups (1 chosen) with a shared expert and a router score bias."""
    torch.manual_seed(seed)
    config = KimiLinearConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.1,
    )
    model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):  # (zeros at init: a bias that changes the choice shows if it is dropped)
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4) * 0.1)
    return model


TINY_TARGETS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5, "qwen3_moe": tiny_qwen3_moe,
                "qwen3_next": tiny_qwen3_next}
SLIDING_TARGETS = {"mistral": tiny_mistral, "gemma3": tiny_gemma3, "gpt_oss": tiny_gpt_oss}
# The key per-target tests (greedy identity with random and oracle drafters in every mode, tree vs sequential logits,
# committed state, the adapter's unit checks) also run Qwen3.5-MoE (Qwen3.5's layers with Qwen3-Next's MoE blocks),
# the sliding-window targets and Kimi Linear; the rest of the per-target set would add CI time and little coverage.
KEY_TEST_TARGETS = {**TINY_TARGETS, "qwen3_5_moe": tiny_qwen3_5_moe, **SLIDING_TARGETS, "kimi_linear": tiny_kimi_linear}
