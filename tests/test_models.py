"""DFlash drafter and Weaver adapter: state-dict layouts, cache and mask semantics, configs, remote-code round trip."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, LlamaConfig, Qwen3_5Config, Qwen3_5TextConfig, Qwen3Config

from zlab_fixture import zlab_config, zlab_tensors

from modeling_weaver.configuration_dflash import DFlashConfig, dflash_target_layer_ids
from modeling_weaver.configuration_weaver import WeaverConfig
from modeling_weaver.modeling_dflash import DFlashDraftModel
from modeling_weaver.modeling_weaver import WeaverModel
from modeling_weaver.tree import weaver_tree

H, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, TARGET_LAYERS = 64, 4, 2, 16, 96, 101, 8
TOL = dict(atol=1e-5, rtol=1e-5)


def target_qwen3(**kw):
    fields = dict(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=FFN, num_hidden_layers=TARGET_LAYERS, vocab_size=VOCAB, rms_norm_eps=1e-5,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    return Qwen3Config(**{**fields, **kw})


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial weights everywhere (norm gains around 1, biases around 0) so tests see every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise / max(p.shape[-1], 1) ** 0.5)
    return model.eval()


def make_dflash(mask_token_id=7, block_size=6, num_hidden_layers=2, ids=(1, 5), seed=0) -> DFlashDraftModel:
    config = DFlashConfig.from_target_config(
        target_qwen3(), num_hidden_layers=num_hidden_layers, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=list(ids),
    )
    return randomize(DFlashDraftModel(config), seed)


def make_weaver(num_layers=2, seed=0, **kw) -> WeaverModel:
    fields = dict(d_model=48, d_embed=40, d_rank=32, num_heads=4, mlp_dim=24, K=7, num_layers=num_layers,
                  candidate_pool_size=16)
    fields.update(kw)
    return randomize(WeaverModel(WeaverConfig(**fields)), seed)


# ------------------------------------------------------------------------------------------------------------- DFlash


def dflash_keys(num_layers: int) -> set[str]:
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        keys |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        attn = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        keys |= {f"layers.{i}.self_attn.{n}.weight" for n in attn}
        keys |= {f"layers.{i}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys


@pytest.mark.parametrize("mask_token_id", [7, None])
def test_dflash_state_dict_layout(mask_token_id):
    model = make_dflash(mask_token_id=mask_token_id, ids=(1, 3, 5))
    sd = model.state_dict()
    expected = dflash_keys(2) | ({"mask_embedding"} if mask_token_id is None else set())
    assert set(sd) == expected
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["hidden_norm.weight"].shape == sd["norm.weight"].shape == (H,)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (KV_HEADS * HEAD_DIM, H)
    assert sd["layers.0.self_attn.o_proj.weight"].shape == (H, HEADS * HEAD_DIM)
    assert sd["layers.1.self_attn.k_norm.weight"].shape == (HEAD_DIM,)
    assert sd["layers.1.mlp.down_proj.weight"].shape == (H, FFN)
    if mask_token_id is None:
        assert sd["mask_embedding"].shape == (H,)
        # learned mask embedding is initialised (not left at zero)
        assert DFlashDraftModel(model.config).mask_embedding.abs().sum() > 0


def test_dflash_cache_incremental_equals_full():
    """Context given all at once == fed through the cache in pieces, cropping block K/V after each draft."""
    model = make_dflash()
    torch.manual_seed(1)
    feats = torch.randn(2, 11, 2 * H)  # target features of positions 0..10
    blocks = [torch.randn(2, 6, H) for _ in range(3)]

    def full(n, block):  # drafter at positions n..n+5 with context 0..n-1, no cache
        return model(block, feats[:, :n], torch.arange(n + 6)[None].expand(2, -1))

    cache = model.new_cache()
    seen = 0
    with torch.no_grad():
        for n, block in zip((4, 5, 11), blocks):
            pos = torch.arange(seen, n + 6)[None].expand(2, -1)
            out = model(block, feats[:, seen:n], pos, past_key_values=cache, use_cache=True)
            assert cache.get_seq_length() == n + 6
            model.crop_cache(cache, n)
            assert cache.get_seq_length() == n
            torch.testing.assert_close(out, full(n, block), **TOL)
            seen = n


def test_dflash_empty_context_and_position_check():
    model = make_dflash()
    block = torch.randn(1, 6, H)
    out = model(block, torch.zeros(1, 0, 2 * H), torch.arange(3, 9)[None])
    assert out.shape == (1, 6, H)
    with pytest.raises(ValueError, match="position_ids"):
        model(block, torch.zeros(1, 2, 2 * H), torch.arange(6)[None])


def test_dflash_noncausal_within_block():
    model = make_dflash()
    feats, block = torch.randn(1, 5, 2 * H), torch.randn(1, 6, H)
    pos = torch.arange(11)[None]
    with torch.no_grad():
        out = model(block, feats, pos)
        changed = block.clone()
        changed[:, -1] += 1.0
        out2 = model(changed, feats, pos)
        assert not torch.allclose(out[:, 0], out2[:, 0])  # the last token reaches the first
        feats2 = feats.clone()
        feats2[:, 2] += 1.0
        assert not torch.allclose(model(block, feats2, pos), out)  # context reaches the block


def test_dflash_training_mask_equals_per_block_drafting():
    """Many blocks in one pass with the block-sparse mask == drafting each block on its own prefix."""
    model = make_dflash()
    torch.manual_seed(2)
    feats = torch.randn(1, 12, 2 * H)
    anchors = torch.tensor([[3, 8]])
    blocks = torch.randn(1, 12, H)
    pos = torch.cat([torch.arange(12), 3 + torch.arange(6), 8 + torch.arange(6)])[None]
    mask = DFlashDraftModel.block_attention_mask(anchors, 12, 6)
    assert mask.shape == (1, 1, 12, 24)
    with torch.no_grad():
        together = model(blocks, feats, pos, attention_mask=mask)
        for j, a in enumerate(anchors[0].tolist()):
            alone = model(blocks[:, 6 * j : 6 * j + 6], feats[:, :a], torch.arange(a + 6)[None])
            torch.testing.assert_close(together[:, 6 * j : 6 * j + 6], alone, **TOL)


@pytest.mark.parametrize("mask_token_id", [7, None])
def test_dflash_block_embeddings(mask_token_id):
    model = make_dflash(mask_token_id=mask_token_id)
    embed = torch.nn.Embedding(VOCAB, H)
    emb = model.block_embeddings(torch.tensor([3, 9]), embed)
    assert emb.shape == (2, 6, H)
    torch.testing.assert_close(emb[:, 0], embed(torch.tensor([3, 9])))
    mask_row = embed.weight[7] if mask_token_id is not None else model.mask_embedding
    torch.testing.assert_close(emb[:, 1:], mask_row.expand(2, 5, H))


def test_dflash_sliding_layers_follow_zlab():
    """z-lab: sliding_attention layers are causal inside the block (unless `is_causal` is set) and windowed."""
    config = DFlashConfig.from_target_config(target_qwen3(), num_hidden_layers=2, block_size=6, mask_token_id=7,
                                             target_layer_ids=[1, 5], layer_types=["sliding_attention",
                                             "full_attention"], use_sliding_window=True, sliding_window=3)
    attn = DFlashDraftModel(config).layers[0].self_attn
    mask = attn.layer_mask(2, 5, "cpu")
    assert mask.tolist() == [[False, True, True, True, False], [False, False, True, True, True]]
    config.is_causal = False
    assert DFlashDraftModel(config).layers[0].self_attn.layer_mask(1, 5, "cpu").tolist() == [
        [False, False, True, True, True]
    ]


def test_dflash_attention_backends_agree():
    config = DFlashConfig.from_target_config(target_qwen3(), num_hidden_layers=2, block_size=6, mask_token_id=7,
                                             target_layer_ids=[1, 5], layer_types=["sliding_attention",
                                             "full_attention"], use_sliding_window=True, sliding_window=4)
    model = randomize(DFlashDraftModel(config))
    args = (torch.randn(2, 6, H), torch.randn(2, 4, 2 * H), torch.arange(10)[None].expand(2, -1))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        sdpa = model(*args)
        model.set_attn_implementation("eager")
        torch.testing.assert_close(model(*args), sdpa, **TOL)


ZLAB_CONFIG = zlab_config(
    hidden=H, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, ffn=FFN, layers=5, block=16, vocab=151936,
    mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, eos_token_id=151645,
)


def test_zlab_checkpoint_loads_unchanged(tmp_path):
    tensors = zlab_tensors(ZLAB_CONFIG, seed=0)
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    model, info = DFlashDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert set(model.state_dict()) == set(tensors) == dflash_keys(5)
    for key, value in tensors.items():
        assert torch.equal(model.state_dict()[key].to(torch.bfloat16), value), key
    cfg = model.config
    assert isinstance(cfg, DFlashConfig) and cfg.model_type == "dflash"
    assert cfg.mask_token_id == 151669 and cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert (cfg.block_size, cfg.num_target_layers, cfg.rope_parameters["rope_theta"]) == (16, 36, 1e6)
    assert model.mask_embedding is None

    model = model.float().eval()
    out = model(torch.randn(1, 16, H), torch.randn(1, 3, 5 * H), torch.arange(19)[None])
    assert out.shape == (1, 16, H) and torch.isfinite(out).all()


def test_zlab_legacy_top_level_fields():
    config = DFlashConfig.from_dict({**ZLAB_CONFIG, "dflash_config": None, "mask_token_id": 5,
                                     "target_layer_ids": [24, 30, 31, 32, 34]})
    assert config.mask_token_id == 5 and config.target_layer_ids == [24, 30, 31, 32, 34]
    derived = DFlashConfig.from_dict({**ZLAB_CONFIG, "dflash_config": {"mask_token_id": 5}})
    assert derived.target_layer_ids == [1, 9, 17, 25, 33]  # from num_target_layers, one per drafter layer


def remote_class_check(loaded, ours):
    assert type(loaded).__name__ == type(ours).__name__
    assert type(loaded).__module__ != type(ours).__module__  # came from the copied code, not from this package


def test_dflash_save_and_automodel_round_trip(tmp_path):
    model = make_dflash(mask_token_id=None)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_dflash.DFlashConfig",
                                  "AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["dflash_config"] == {"mask_token_id": None, "target_layer_ids": [1, 5]}
    for name in ("configuration_dflash.py", "modeling_dflash.py", "model.safetensors"):
        assert (tmp_path / name).exists(), name

    assert type(AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)).__name__ == "DFlashConfig"
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    remote_class_check(loaded, model)
    args = (torch.randn(1, 6, H), torch.randn(1, 4, 2 * H), torch.arange(10)[None])
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), model(*args), atol=0, rtol=0)


def test_zlab_checkpoint_resaves_as_our_code(tmp_path):
    src, dst = tmp_path / "zlab", tmp_path / "ours"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    save_file(zlab_tensors(ZLAB_CONFIG, seed=1), str(src / "model.safetensors"), metadata={"format": "pt"})
    DFlashDraftModel.from_pretrained(src).save_pretrained(dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    assert config["model_type"] == "dflash"
    assert AutoModel.from_pretrained(dst, trust_remote_code=True).config.mask_token_id == 151669


# ----------------------------------------------------------------------------------------------------- DFlash configs


def test_target_layer_spread():
    assert dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert dflash_target_layer_ids(28, 1) == [14]
    assert dflash_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="cannot spread 6 distinct feature layers"):
        dflash_target_layer_ids(8, 6)
    with pytest.raises(ValueError, match="at least one"):
        dflash_target_layer_ids(36, 0)


def llama_target():
    return LlamaConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=FFN,
                       num_hidden_layers=TARGET_LAYERS, vocab_size=VOCAB, rms_norm_eps=1e-5,
                       max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 5e5})


def qwen3_5_text():
    return Qwen3_5TextConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             head_dim=HEAD_DIM, intermediate_size=FFN, num_hidden_layers=TARGET_LAYERS,
                             vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                              "partial_rotary_factor": 0.25})


TARGETS = {
    "llama": llama_target,
    "qwen3": target_qwen3,
    "qwen3_5_text": qwen3_5_text,
    "qwen3_5": lambda: Qwen3_5Config(text_config=qwen3_5_text().to_dict()),
}


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_dflash_from_target_config(family):
    target = TARGETS[family]()
    config = DFlashConfig.from_target_config(target, num_hidden_layers=3, block_size=8, mask_token_id=4)
    assert (config.hidden_size, config.vocab_size, config.intermediate_size) == (H, VOCAB, FFN)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config.rms_norm_eps == 1e-5 and config.num_hidden_layers == 3 and config.block_size == 8
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}  # no partial rotary
    assert config.num_target_layers == TARGET_LAYERS and config.target_layer_ids == [1, 3, 5]
    assert config.mask_token_id == 4 and config.layer_types == ["full_attention"] * 3
    assert config.max_position_embeddings == (1024 if family == "qwen3" else 2048)
    model = DFlashDraftModel(config)
    assert model.fc.weight.shape == (H, 3 * H)
    assert model(torch.randn(1, 8, H), torch.randn(1, 2, 3 * H), torch.arange(10)[None]).shape == (1, 8, H)


def kimi_linear_48b_a3b():
    """Kimi Linear 48B-A3B's published sizes, in transformers' class (MLA: q heads 128 + 64 RoPE dims, latent 512)."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_local_experts=256, num_experts_per_tok=8, linear_head_dim=128,
        linear_num_heads=32)


def test_dflash_from_target_config_kimi_linear():
    """Kimi Linear's ``head_dim`` is MLA's RoPE part (64 at 48B-A3B, 4 in the tiny one): the drafter takes hidden /
    heads instead (72: 32 heads as wide as the hidden state), and the dense layer's FFN."""
    from tiny_targets import tiny_kimi_linear

    for target, heads, head_dim, ffn in ((kimi_linear_48b_a3b(), 32, 72, 9216), (tiny_kimi_linear().config, 4, 8, 64)):
        assert target.head_dim == target.qk_rope_head_dim != head_dim
        config = DFlashConfig.from_target_config(target, num_hidden_layers=2, block_size=8, target_layer_ids=[0, 1])
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (heads, heads, head_dim)
        assert config.num_attention_heads * config.head_dim == config.hidden_size == target.hidden_size
        assert config.intermediate_size == ffn and config.vocab_size == target.vocab_size
    model = DFlashDraftModel(config)  # (the tiny one's)
    assert model.layers[0].self_attn.q_proj.weight.shape == (32, 32)
    assert model(torch.randn(1, 8, 32), torch.randn(1, 2, 64), torch.arange(10)[None]).shape == (1, 8, 32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_hidden_layers=6), "cannot spread 6"),
        (dict(target_layer_ids=[1, 8]), r"out of range for a 8-layer target"),
        (dict(target_layer_ids=[2, 2]), "distinct"),
        (dict(target_layer_ids=[]), "must not be empty"),
        (dict(mask_token_id=VOCAB), "outside the target vocabulary"),
        (dict(hidden_size=32), "hidden_size must equal"),
    ],
)
def test_dflash_from_target_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_target_config(target_qwen3(), **kwargs)


# ------------------------------------------------------------------------------------------------------------- Weaver


def weaver_keys(num_layers: int) -> dict[str, tuple[int, ...]]:
    d_model, d_embed, d_rank, mlp = 48, 40, 32, 24
    keys = {
        "output_norm.weight": (d_model,), "output_norm.bias": (d_model,),
        "embed_norm.weight": (d_embed,), "embed_norm.bias": (d_embed,),
        "token_in.weight": (d_rank, d_embed), "token_in.bias": (d_rank,),
        "proposal_in.weight": (d_rank, d_model), "proposal_in.bias": (d_rank,),
        "out_norm.weight": (d_rank,), "out_norm.bias": (d_rank,),
        "lm_head_query_in.weight": (d_model, d_rank),
    }
    for i in range(num_layers):
        keys |= {
            f"blocks.{i}.norm_attn.weight": (d_rank,), f"blocks.{i}.norm_attn.bias": (d_rank,),
            f"blocks.{i}.qkv_proj.weight": (3 * d_rank, d_rank), f"blocks.{i}.o_proj.weight": (d_rank, d_rank),
            f"blocks.{i}.norm_mlp.weight": (d_rank,), f"blocks.{i}.norm_mlp.bias": (d_rank,),
            f"blocks.{i}.gate_up_proj.weight": (2 * mlp, d_rank), f"blocks.{i}.gate_up_proj.bias": (2 * mlp,),
            f"blocks.{i}.down_proj.weight": (d_rank, mlp), f"blocks.{i}.down_proj.bias": (d_rank,),
        }
    return keys


def test_weaver_state_dict_layout():
    sd = make_weaver(num_layers=2).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == weaver_keys(2)


# A small tree in topological order: 0 → {1, 2}, 1 → 3, 2 → 4, 3 → 5.
PARENTS = [-1, 0, 0, 1, 2, 3]
DEPTHS = [0, 1, 1, 2, 2, 3]


def ancestor_mask(parents, size):
    mask = torch.zeros(len(parents), size, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def run_tree(weaver, prompt, x, groups, size=8, as_slices=False):
    """Expand the tree's nodes in the given groups (each one `step` call); returns ``[N, d_model]`` queries.
    ``as_slices``: pass each (contiguous) group's slots as a ``slice`` instead of an index tensor."""
    cache = weaver.new_node_cache(size)
    mask = ancestor_mask(PARENTS, size)
    out = torch.empty(len(PARENTS), weaver.config.d_model)
    for group in groups:
        idx = torch.tensor(group)
        slots = slice(group[0], group[-1] + 1) if as_slices else idx[None]
        out[idx] = weaver.step(prompt, cache, x[idx][None], torch.tensor(DEPTHS)[idx][None], slots, mask[idx][None])[0]
    return out


@pytest.fixture
def weaver_setup():
    weaver = make_weaver(num_layers=2)
    torch.manual_seed(3)
    prompt = weaver.encode_prompt(torch.randn(1, 48), torch.randn(1, 5, 48))
    x = weaver.node_inputs(torch.randn(len(PARENTS), 40))
    return weaver, prompt, x


def test_weaver_batched_step_equals_one_by_one(weaver_setup):
    weaver, prompt, x = weaver_setup
    assert prompt.length == 6 and prompt.keys[0].shape == (1, 4, 6, 8)
    with torch.no_grad():
        single = run_tree(weaver, prompt, x, [[i] for i in range(6)])
        rounds = run_tree(weaver, prompt, x, [[0], [1, 2], [3, 4], [5]])
        at_once = run_tree(weaver, prompt, x, [list(range(6))])  # ancestors inside the same call
        sliced = run_tree(weaver, prompt, x, [[0], [1, 2], [3, 4], [5]], as_slices=True)
    torch.testing.assert_close(rounds, single, **TOL)
    torch.testing.assert_close(at_once, single, **TOL)
    assert torch.equal(sliced, rounds)  # consecutive slots as a slice: the same cache writes, as copies


def test_weaver_batch_rows_are_independent(weaver_setup):
    weaver, _, x = weaver_setup
    torch.manual_seed(4)
    u0, dh = torch.randn(2, 48), torch.randn(2, 5, 48)
    depths, slots, mask = torch.tensor([[0, 1, 1]]), torch.tensor([[0, 1, 2]]), ancestor_mask(PARENTS[:3], 3)[None]
    with torch.no_grad():
        prompt = weaver.encode_prompt(u0, dh)
        both = weaver.step(prompt, weaver.new_node_cache(3, batch_size=2), x[:3][None].repeat(2, 1, 1),
                           depths.repeat(2, 1), slots.repeat(2, 1), mask.repeat(2, 1, 1))
        for b in range(2):
            alone = weaver.step(weaver.encode_prompt(u0[b : b + 1], dh[b : b + 1]), weaver.new_node_cache(3),
                                x[:3][None], depths, slots, mask)
            torch.testing.assert_close(both[b], alone[0], **TOL)


def test_weaver_node_sees_only_prompt_and_ancestors(weaver_setup):
    weaver, prompt, x = weaver_setup
    with torch.no_grad():
        base = run_tree(weaver, prompt, x, [[0], [1, 2], [3, 4], [5]])
        other = x.clone()
        other[[2, 4]] += 1.0  # the other branch: siblings / cousins of 1, 3, 5
        moved = run_tree(weaver, prompt, other, [[0], [1, 2], [3, 4], [5]])
        torch.testing.assert_close(moved[[0, 1, 3, 5]], base[[0, 1, 3, 5]], **TOL)
        assert not torch.allclose(moved[[2, 4]], base[[2, 4]])
        ancestor = x.clone()
        ancestor[1] += 1.0
        assert not torch.allclose(run_tree(weaver, prompt, ancestor, [list(range(6))])[5], base[5])
        new_prompt = weaver.encode_prompt(torch.randn(1, 48), torch.randn(1, 5, 48))
        assert not torch.allclose(run_tree(weaver, new_prompt, x, [list(range(6))]), base)


def test_weaver_prompt_is_causal_and_capped_at_K():
    weaver = make_weaver(num_layers=2, K=4)
    u0, dh = torch.randn(1, 48), torch.randn(1, 6, 48)
    with torch.no_grad():
        full = weaver.encode_prompt(u0, dh)
        assert full.length == 5  # 1 + min(depth, K)
        prefix = weaver.encode_prompt(u0, dh[:, :2])
        for layer in range(2):  # earlier entries do not see later ones
            torch.testing.assert_close(full.keys[layer][:, :, :3], prefix.keys[layer], **TOL)
            torch.testing.assert_close(full.values[layer][:, :, :3], prefix.values[layer], **TOL)


def test_weaver_forward_is_teacher_forced_chain():
    weaver = make_weaver()
    u0, dh, e = torch.randn(1, 48), torch.randn(1, 5, 48), torch.randn(1, 4, 40)
    with torch.no_grad():
        chain = weaver(u0, dh, e)
        prompt, cache = weaver.encode_prompt(u0, dh), weaver.new_node_cache(4)
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        for t in range(4):
            step = weaver.step(prompt, cache, weaver.node_inputs(e[:, t : t + 1]), torch.tensor([[t]]),
                               torch.tensor([[t]]), mask[t][None, None])
            torch.testing.assert_close(chain[:, t], step[:, 0], **TOL)


class _Spy(torch.overrides.TorchFunctionMode):
    """Records the torch functions that receive the full lm_head weight."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.seen = weight, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(a is self.weight for a in args):
            self.seen.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_candidate_logits_gather_pool_rows_only():
    torch.manual_seed(5)
    lm_head = torch.randn(VOCAB, 48)
    query = torch.randn(3, 48)
    pool_ids = torch.stack([torch.randperm(VOCAB)[:16] for _ in range(3)])
    pool_logits = torch.randn(3, 16)
    with _Spy(lm_head) as spy:
        logits = WeaverModel.candidate_logits(query, pool_ids, pool_logits, lm_head)
    assert spy.seen == {"__getitem__"}  # row gather only, never a [V, d_model] matmul
    full = query @ lm_head.T  # [3, V]
    torch.testing.assert_close(logits, pool_logits + full.gather(-1, pool_ids), **TOL)
    assert logits.dtype == torch.float32


def _tree_inputs(seed: int, depth: int = 5, scale: float = 3.0):
    """A random Weaver with what a tree build takes: ``weaver, embed, lm_head, prompt, draft_logits [depth, V]``."""
    torch.manual_seed(seed)
    weaver = make_weaver()
    embed, lm_head = torch.nn.Embedding(VOCAB, 40), torch.randn(VOCAB, 48)
    prompt = weaver.encode_prompt(torch.randn(1, 48), torch.randn(1, depth, 48))
    return weaver, embed, lm_head, prompt, scale * torch.randn(depth, VOCAB)


@contextlib.contextmanager
def _counted_steps(weaver):
    """The number of nodes of each node step inside the block: ``weaver.step``'s, or on a CPU with the native kernels
    ``CpuWeaver.step``'s (``depths [1, M]`` or ``positions [M]``: its fourth argument)."""
    from modeling_weaver.tree import CpuWeaver

    steps, step, cpu_step = [], weaver.step, CpuWeaver.step
    weaver.step = lambda *args, **kwargs: steps.append(args[3].shape[1]) or step(*args, **kwargs)
    CpuWeaver.step = lambda self, *args, **kwargs: steps.append(args[3].shape[0]) or cpu_step(self, *args, **kwargs)
    try:
        yield steps
    finally:
        del weaver.step
        CpuWeaver.step = cpu_step


# the interpreted kernel at the two smaller budgets (rounds of 2 and 3 nodes): slow under the interpreter at 30
@pytest.mark.parametrize("budget,width,attention", [(b, w, a) for b, w in ((12, None), (30, 4), (7, 3))
                                                    for a in ("torch", "op", "kernel") if (b, a) != (30, "kernel")])
def test_weaver_drives_the_tree_builder(budget, width, attention, monkeypatch):
    """Fixed-size best-first tree; each node's logq is the Weaver's log-prob of its token given its own root path
    (recomputed by teacher forcing the path in one call, torch attention), so the batched rounds' cache and masks are
    right; one node step per round of ``width`` new nodes and none for the nodes that fill the budget
    (ceil(budget / width) steps). The rounds' attention: WeaverModel.step's torch ops, the ``node_attention`` op
    (its CPU form), and the op's Triton kernel under the interpreter."""
    from modeling_weaver.options import TreePolicy

    policy = TreePolicy(fused_node_attention=attention != "torch")
    if attention == "kernel":
        pytest.importorskip("triton")  # (the Triton kernel under its CPU interpreter: only where Triton is installed)
        import weaver_kernels
        from weaver_kernels.utils import load_interpreted

        kernel = load_interpreted("weaver_kernels.weaver_tree.attention").node_attention_triton
        monkeypatch.setattr(weaver_kernels, "node_attention", lambda *args: kernel(*args, BL=16))
    weaver, embed, lm_head, prompt, draft_logits = _tree_inputs(budget)
    with torch.no_grad():
        with _counted_steps(weaver) as steps:
            tree = weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=budget, width=width,
                               spine=False, policy=policy)
        assert len(tree) == budget + 1 and int(tree.depths.max()) <= 5
        # the default width: the widest that leaves a round per depth
        used = width or max(1, (budget - 1) // (min(5, weaver.config.K) - 1))
        assert steps[0] == 1 and len(steps) == -(-budget // used) and max(steps) <= used, steps
        parents = tree.parents.tolist()
        assert all(-1 <= p < i for i, p in enumerate(parents)) and (tree.parents[1:] >= 0).all()
        pool_logits, pool_ids = draft_logits.float().topk(16, dim=-1)
        for node in range(1, len(tree)):
            path = tree.path_to(node)  # root..node
            chain = torch.tensor(path[:-1])
            depth = torch.arange(len(chain))
            x = weaver.node_inputs(embed(tree.tokens[chain]))[None]
            causal = torch.ones(len(chain), len(chain)).tril().bool()[None]
            query = weaver.step(prompt, weaver.new_node_cache(len(chain)), x, depth[None], depth[None], causal)[0, -1]
            d = len(chain) - 1
            logp = torch.log_softmax(weaver.candidate_logits(query, pool_ids[d], pool_logits[d], lm_head), -1)
            expected = logp[(pool_ids[d] == tree.tokens[node]).nonzero()[0, 0]]
            assert torch.allclose(tree.logq[node], expected, atol=1e-5), node


def _teacher_forced_logp(weaver, prompt, embed, lm_head, tokens, pool_ids, pool_logits):
    """The Weaver's log-probs over the pool of the children of the path ``tokens`` (root first), in one call."""
    chain = torch.tensor(tokens)
    depth = torch.arange(len(chain))
    x = weaver.node_inputs(embed(chain))[None]
    causal = torch.ones(len(chain), len(chain)).tril().bool()[None]
    query = weaver.step(prompt, weaver.new_node_cache(len(chain)), x, depth[None], depth[None], causal)[0, -1]
    d = len(chain) - 1
    return torch.log_softmax(weaver.candidate_logits(query, pool_ids[d], pool_logits[d], lm_head), -1)


@pytest.mark.parametrize("budget,rounds,width,root,scale", [
    (7, 0, None, 8, 3.0), (16, 2, None, 8, 3.0), (30, 2, 3, 8, 3.0), (12, 1, 5, 8, 3.0),
    (16, 2, None, 12, 0.1), (30, 1, 3, 32, 0.3), (3, 1, None, 8, 0.3), (4, 2, 2, 8, 3.0)])
def test_weaver_spine_tree_is_the_best_known_paths(budget, rounds, width, root, scale, monkeypatch):
    """Spine trees (``spine=True``): one node step for the root and DFlash's chain together (but its deepest node,
    whose children could not join), then ``rounds`` steps of
    ``width`` nodes; the tree equals a plain search written out here — the Weaver's log-probs of every path recomputed
    by teacher forcing, the chain's nodes stepped, each stepped node's ``fan`` best children (the chain child not
    twice) as candidates, each round stepping the best unstepped candidates, the root's next best children up to
    ``root`` in all (``TreePolicy.root_children``; 32: more than its pool holds) as leaves never stepped, and the
    ``budget`` most probable paths of all of them kept. (Flat draft logits make the root's later children likely
    enough to be kept.) A budget below the depth caps the depth: no path of a ``budget``-node tree is deeper, so the
    search neither steps nor offers deeper nodes."""
    from modeling_weaver.options import TreePolicy

    weaver, embed, lm_head, prompt, draft_logits = _tree_inputs(budget, scale=scale)
    lm_head = lm_head * min(1.0, scale)  # (and small Weaver residuals)
    with torch.no_grad():
        with _counted_steps(weaver) as steps:
            tree = weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=budget, width=width,
                               spine=True, rounds=rounds, policy=TreePolicy(root_children=root))
        used = width or -(-budget // 8)
        fan, max_depth = 8, min(5, budget)
        assert steps == [max_depth] + [used] * rounds, steps  # (the spine's deepest node: never stepped)
        pool_logits, pool_ids = draft_logits.float().topk(16, dim=-1)

        # the search written out: paths are token tuples from the root
        score = {(3,): 0.0}
        candidates = {}  # unstepped path -> score
        leaves = {}  # the root's children past its fan: in the tree or not, never stepped

        def stepped(path):
            if len(path) - 1 == max_depth:
                return
            logp = _teacher_forced_logp(weaver, prompt, embed, lm_head, list(path), pool_ids, pool_logits)
            chain_child = len(path) <= max_depth and path == spine[: len(path)]
            order = [j for j in logp.argsort(descending=True).tolist() if not (chain_child and j == 0)]
            for j in order[:fan]:
                candidates[path + (int(pool_ids[len(path) - 1, j]),)] = score[path] + float(logp[j])
            for j in order[fan:root] if len(path) == 1 else []:
                leaves[path + (int(pool_ids[0, j]),)] = float(logp[j])

        spine = (3,) + tuple(pool_ids[:, 0].tolist())
        for d in range(1, max_depth + 1):
            logp = _teacher_forced_logp(weaver, prompt, embed, lm_head, list(spine[:d]), pool_ids, pool_logits)
            score[spine[: d + 1]] = score[spine[:d]] + float(logp[0])
        for d in range(max_depth + 1):
            stepped(spine[: d + 1])
        for _ in range(rounds):
            best = sorted(candidates, key=candidates.get, reverse=True)[:used]
            for path in best:
                score[path] = candidates.pop(path)
            for path in best:
                stepped(path)
        known = {**{p: v for p, v in score.items() if len(p) > 1}, **candidates, **leaves}
        assert len(leaves) == max(0, min(root, 15) - fan)  # (a pool of 16, one of them the spine child)
        expected = sorted(known, key=known.get, reverse=True)[:budget]

        assert len(tree) == budget + 1 and (tree.parents[1:] >= 0).all()
        paths = [tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(1, len(tree))]
        assert paths == expected  # same paths, most probable first
        assert (root > fan) == any(path in leaves for path in paths)
        for i, path in enumerate(paths, start=1):
            assert abs(float(tree.logq[i]) - (known[path] - score.get(path[:-1], 0.0))) < 1e-4, path


def test_weaver_spine_tree_arguments():
    """``rounds`` goes with spine trees only and is not negative; at maximum depth 1 every candidate is a leaf, so the
    spine's step is the only one, and it steps the root alone (its one spine node publishes nothing)."""
    weaver, embed, lm_head, prompt, draft_logits = _tree_inputs(0, depth=1, scale=1.0)
    with torch.no_grad():
        for bad in (dict(spine=True, rounds=-1), dict(spine=False, rounds=2)):
            with pytest.raises(ValueError, match="rounds"):
                weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=8, **bad)
        with _counted_steps(weaver) as steps:
            tree = weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=8, spine=True, rounds=3)
    assert steps == [1] and (tree.depths[1:] == 1).all() and (tree.parents[1:] == 0).all()


def test_weaver_spine_tree_when_the_chain_is_certain():
    """DFlash's chain certain (pool log-prob 0.0 in fp32: every spine node ties with its parent): the whole chain is
    in the tree, parents first."""
    weaver, embed, lm_head, prompt, draft_logits = _tree_inputs(0, scale=1.0)
    peaks = torch.randperm(VOCAB)[:5]
    draft_logits[torch.arange(5), peaks] = 1e4
    with torch.no_grad():
        tree = weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=9, spine=True, rounds=1)
    assert tree.tokens[1:6].tolist() == peaks.tolist() and tree.parents[1:6].tolist() == [0, 1, 2, 3, 4]
    assert (tree.logq[1:6] == 0).all() and all(0 <= p < i for i, p in enumerate(tree.parents.tolist()) if i)


@pytest.mark.parametrize("budget", [7, 16, 30, 64, 128])
def test_weaver_tree_default_width_reaches_full_depth(budget):
    """With one dominant token per depth (planted in the draft marginals), the default expansion width still leaves
    enough rounds for the best-first tree to hold the whole peaked path: a node of depth d needs d rounds (K = 15, the
    real drafters' depth); a spine tree (the default) holds it after its few rounds."""
    torch.manual_seed(budget)
    K = 15
    weaver = make_weaver(K=K)
    embed, lm_head = torch.nn.Embedding(VOCAB, 40), torch.randn(VOCAB, 48)
    prompt = weaver.encode_prompt(torch.randn(1, 48), torch.randn(1, K, 48))
    draft_logits = torch.randn(K, VOCAB)
    peaks = torch.randint(0, VOCAB, (K,))
    draft_logits[torch.arange(K), peaks] += 100.0
    with torch.no_grad():
        tree = weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=budget, spine=False)
        wide = weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=budget, width=-(-budget // 8),
                           spine=False)
        spined = weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=budget)  # the default
    depth = min(K, budget)
    for t in (tree, spined):
        assert int(t.depths.max()) == depth
        deepest = int(t.depths.argmax())
        assert t.tokens[t.path_to(deepest)[1:]].tolist() == peaks[:depth].tolist()
    assert budget < 9 or int(wide.depths.max()) < depth  # negative control: 8 rounds hold depth 8 at most


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_weaver_from_target_config(family):
    target = TARGETS[family]()
    dflash = DFlashConfig.from_target_config(target, num_hidden_layers=2, block_size=10)
    config = WeaverConfig.from_target_config(target, dflash)
    assert (config.d_model, config.d_embed, config.d_rank, config.K) == (H, H, H, 9)
    # the default pool is 512 candidates, never more than the vocabulary holds (this tiny one: 101, issue 28)
    assert config.num_layers == 1 and config.candidate_pool_size == min(512, dflash.vocab_size)
    assert config.head_dim % 2 == 0 and config.d_rank % config.num_heads == 0
    assert config.mlp_dim == 48  # ⌈2/3 · 64⌉ rounded up to a multiple of 8
    WeaverModel(config)


def test_weaver_defaults_at_paper_shape():
    target = Qwen3_5Config(text_config=dict(hidden_size=5120, num_hidden_layers=64, vocab_size=248320,
                                            num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                                            intermediate_size=17408))
    dflash = DFlashConfig.from_target_config(target, mask_token_id=248070)
    assert dflash.target_layer_ids == [1, 16, 31, 46, 61]
    config = WeaverConfig.from_target_config(target, dflash)
    assert (config.d_rank, config.num_heads, config.mlp_dim, config.K) == (2048, 16, 1368, 15)
    with torch.device("meta"):
        params = sum(p.numel() for p in WeaverModel(config).parameters())
    assert round(params / 1e6, 1) == 56.7  # the paper's parameter count for one layer at d_rank 2048


def test_weaver_config_rejects():
    target, dflash = target_qwen3(), DFlashConfig.from_target_config(target_qwen3(), num_hidden_layers=2)
    other = DFlashConfig.from_target_config(target_qwen3(), num_hidden_layers=2)
    other.hidden_size = 32
    with pytest.raises(ValueError, match="target hidden size 64 != DFlash hidden size 32"):
        WeaverConfig.from_target_config(target, other)
    with pytest.raises(ValueError, match="K .* must cover"):
        WeaverConfig.from_target_config(target, dflash, K=3)
    with pytest.raises(ValueError, match="must be even"):
        WeaverConfig.from_target_config(target, dflash, d_rank=36, num_heads=4)
    with pytest.raises(ValueError, match="divisible"):
        WeaverConfig(d_rank=30, num_heads=4)
    deeper = DFlashConfig.from_target_config(target_qwen3(num_hidden_layers=12), num_hidden_layers=2)
    with pytest.raises(ValueError, match="12-layer target"):
        WeaverConfig.from_target_config(target, deeper)


def test_weaver_save_and_automodel_round_trip(tmp_path):
    weaver = make_weaver()
    weaver.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_weaver.WeaverConfig",
                                  "AutoModel": "modeling_weaver.WeaverModel"}
    for name in ("configuration_weaver.py", "modeling_weaver.py", "model.safetensors"):
        assert (tmp_path / name).exists(), name
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    remote_class_check(loaded, weaver)
    u0, dh, e = torch.randn(1, 48), torch.randn(1, 5, 48), torch.randn(1, 4, 40)
    with torch.no_grad():
        torch.testing.assert_close(loaded(u0, dh, e), weaver(u0, dh, e), atol=0, rtol=0)


def test_weaver_released_checkpoint(tmp_path):
    weaver = make_weaver()
    cfg = {k: getattr(weaver.config, k) for k in ("d_model", "d_embed", "d_rank", "num_layers", "num_heads",
                                                  "mlp_dim", "K", "candidate_pool_size", "rope_base")}
    payload = {"config": {**cfg, "encoder_mode": 3, "score_head": 4, "activation": "swiglu"},
               "state_dict": weaver.state_dict()}
    torch.save(payload, tmp_path / "weaver.pth")
    loaded = WeaverModel.from_released_checkpoint(tmp_path / "weaver.pth")
    u0, dh, e = torch.randn(1, 48), torch.randn(1, 5, 48), torch.randn(1, 4, 40)
    with torch.no_grad():
        torch.testing.assert_close(loaded(u0, dh, e), weaver(u0, dh, e), atol=0, rtol=0)
    torch.save({**payload, "config": {**payload["config"], "score_head": 2}}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="variant"):
        WeaverModel.from_released_checkpoint(tmp_path / "other.pth")


def _expand_ref_before_host_sums(cand, pool_ids, tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq,
                                 lo, hi, take, max_depth, spine=0):
    """``weaver_expand_ref`` as it was before its CPU trims (spine sums as tensor ops, row gathers in two steps),
    frozen here as the oracle of the test below."""
    n = tokens.shape[0]
    fan = f_score.shape[0] // n
    neg_inf = float("-inf")
    d = depth[lo:hi]
    ids = pool_ids[d.clamp(max=max_depth - 1)]
    logp = torch.log_softmax(cand, dim=-1)
    cols = None
    if spine:
        first = logp[:spine, 0]
        logq[1 : spine + 1] = first
        for k in range(spine):
            score[k + 1] = score[k] + first[k]
        P = cand.shape[1]
        is_parent = (torch.arange(lo, hi) < spine)[:, None]
        cols = torch.where(is_parent, torch.arange(1, P + 1) % P, torch.arange(P))
        logp = torch.where(is_parent & (cols == 0), neg_inf, logp.gather(-1, cols))
    logp, order = logp.sort(dim=-1, descending=True, stable=True)
    if cols is not None:
        order = cols.gather(-1, order)
    top_values, top_indices = logp[:, :fan], order[:, :fan]
    real = (parents[lo:hi] >= 0) | (torch.arange(lo, hi) == 0)
    publish = real & (d < max_depth)
    f_score[lo * fan : hi * fan] = torch.where(publish[:, None], score[lo:hi, None] + top_values, neg_inf).flatten()
    children = ids.gather(-1, top_indices)
    if spine:
        children = torch.where(is_parent & (top_indices == 0), 0, children)
    f_token[lo * fan : hi * fan] = children.flatten()
    f_logq[lo * fan : hi * fan] = top_values.flatten()
    if take == 0:
        return
    best_values, best_indices = (t[:take] for t in f_score.sort(descending=True, stable=True))
    valid = best_values > neg_inf
    parent = best_indices // fan
    new = slice(hi, hi + take)
    tokens[new] = torch.where(valid, f_token[best_indices], 0)
    parents[new] = torch.where(valid, parent, -1)
    logq[new] = torch.where(valid, f_logq[best_indices], neg_inf)
    depth[new] = torch.where(valid, depth[parent] + 1, 0)
    score[new] = best_values
    f_score.index_fill_(0, best_indices, neg_inf)
    nodes = torch.arange(n)
    mask[new] = (mask[parent] & valid[:, None]) | (nodes[None] == nodes[new, None])


def _pool_scores_ref_before_unbind(query, rows, pool_ids, pool_logits, weight):
    """``pool_scores_ref`` as it was before its CPU trims (a row select per node), frozen for the test below."""
    ids = pool_ids[rows]
    residual = [torch.mv(weight.index_select(0, ids[i]), query[i].to(weight.dtype)) for i in range(ids.shape[0])]
    residual = torch.stack(residual) if residual else ids.new_zeros(ids.shape, dtype=weight.dtype)
    return pool_logits[rows].float() + residual.float()


@pytest.mark.parametrize("budget,spine,rounds,width,root,scale", [
    (8, True, None, None, None, 3.0), (8, True, 0, None, None, 0.3), (16, True, 2, None, 12, 1.0),
    (30, True, 1, 3, 32, 0.3), (12, False, None, None, None, 3.0), (7, False, None, 3, None, 0.1)])
def test_weaver_tree_identical_to_the_untrimmed_references(budget, spine, rounds, width, root, scale, monkeypatch):
    """The CPU tree build (the ops' references) gives bit for bit the tree — nodes, order, log-probabilities — that
    it gave before the references' CPU trims (frozen copies above), on random Weavers and draft logits, spine and
    best-first trees, ties included (scale 0.1-0.3: near-flat logits)."""
    import weaver_kernels.ops as ops

    from modeling_weaver.options import TreePolicy

    weaver, embed, lm_head, prompt, draft_logits = _tree_inputs(budget, scale=scale)
    if scale < 1:
        draft_logits = draft_logits.round(decimals=1)  # equal logits: pool order and sorts meet ties

    def build():
        with torch.no_grad():
            return weaver_tree(3, weaver, prompt, draft_logits, embed, lm_head, budget=budget, width=width,
                               spine=spine, rounds=rounds, policy=TreePolicy(root_children=root))

    got = build()
    monkeypatch.setattr(ops, "weaver_expand_ref", _expand_ref_before_host_sums)
    monkeypatch.setattr(ops, "pool_scores_ref", _pool_scores_ref_before_unbind)
    expected = build()
    assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.parents, expected.parents)
    assert torch.equal(got.logq, expected.logq)
