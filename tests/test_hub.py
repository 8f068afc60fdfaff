"""Hub ecosystem: z-lab DFlash checkpoints load unchanged, the Weaver .pth converter, transformers' own chain-DFlash
path, hub_configs/ (in sync, loadable, paired with their targets), custom_generate folders, the model card."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
import zlab_fixture
from tiny_targets import VOCAB, tiny_llama, tiny_qwen3
from transformers import AutoConfig, AutoModel, LlamaConfig, Qwen3_5Config, Qwen3_5TextConfig

from modeling_weaver import DFlashConfig, DFlashDraftModel, WeaverConfig, WeaverModel, speculative_generate
from modeling_weaver.convert import (
    CheckpointError,
    convert_dflash,
    convert_weaver,
    load_dflash,
    load_released_weaver,
    load_weaver,
    read_released_weaver,
    to_transformers_assistant,
)
from modeling_weaver.export import (
    HUB_SPECS,
    PairingError,
    check_pair,
    export_pair,
    render_card,
    sync_hub_configs,
)
from modeling_weaver.output_dir import with_banner

ROOT = Path(__file__).resolve().parents[1]


def reference(target, ids, n):
    # an explicit mask: without one, transformers masks out every prompt token equal to pad_token_id
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           min_new_tokens=0, pad_token_id=0)


def prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in (3, 13)]


# ------------------------------------------------------------------------------------------------ z-lab DFlash format

ZH, ZHEADS, ZKV, ZHD, ZFFN, ZBLOCK, ZLAYERS = 32, 4, 2, 8, 64, 8, 2


def zlab_config(**changes) -> dict:
    """A z-lab DFlash config.json at the tiny Qwen3 target's shape."""
    config = zlab_fixture.zlab_config(
        hidden=ZH, heads=ZHEADS, kv_heads=ZKV, head_dim=ZHD, ffn=ZFFN, layers=ZLAYERS, block=ZBLOCK, vocab=VOCAB,
        mask_token_id=VOCAB - 1, target_layer_ids=[0, 2], num_target_layers=3, bos_token_id=None, eos_token_id=None,
        max_position_embeddings=512,
    )
    return config | changes


def zlab_tensors(seed=0) -> dict[str, torch.Tensor]:
    return zlab_fixture.zlab_tensors(zlab_config(), seed)


def write_zlab(folder: Path, config=None, tensors=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or zlab_config(), indent=2))
    save_file(tensors if tensors is not None else zlab_tensors(), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    # z-lab repos ship their own dflash.py; loading through our package must never execute it.
    (folder / "dflash.py").write_text("raise RuntimeError('z-lab remote code was executed')\n")
    return folder


@pytest.fixture(scope="module")
def zlab_dir(tmp_path_factory):
    return write_zlab(tmp_path_factory.mktemp("zlab") / "Qwen3-tiny-DFlash-b8")


def test_zlab_checkpoint_loads_unchanged_and_is_lossless(zlab_dir, tmp_path):
    target = tiny_qwen3()
    drafter = load_dflash(zlab_dir)
    tensors = zlab_tensors()
    state = drafter.state_dict()
    assert set(state) == set(tensors)
    assert all(torch.equal(state[k], v) for k, v in tensors.items())  # bf16 kept, bit for bit
    assert drafter.config.mask_token_id == VOCAB - 1 and drafter.config.target_layer_ids == [0, 2]
    drafter = drafter.float()

    ours = convert_dflash(zlab_dir, tmp_path / "ours")
    assert json.loads((ours / "config.json").read_text())["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    copied = (ours / "modeling_dflash.py").read_text(encoding="utf-8")
    assert copied == generated_copy("modeling_weaver/modeling_dflash.py")
    remote = AutoModel.from_pretrained(ours, trust_remote_code=True).float().eval()
    assert type(remote).__module__ != type(drafter).__module__  # the copied code, not this package

    torch.manual_seed(0)
    weaver = WeaverModel(WeaverConfig.from_target_config(target.config, drafter.config, d_rank=32, num_heads=4,
                                                         mlp_dim=64, candidate_pool_size=16)).eval()
    for ids in prompts():
        expected = reference(target, ids, 40)
        for mode in ("chain", "ddtree", "weaver"):
            got, stats = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode,
                                              tree_budget=12, max_new_tokens=40, return_stats=True)
            assert torch.equal(got, expected), mode
            again, stats2 = speculative_generate(target, ids, drafter=remote, weaver=weaver, mode=mode,
                                                 tree_budget=12, max_new_tokens=40, return_stats=True)
            assert torch.equal(again, expected) and stats.accepted_lengths == stats2.accepted_lengths, mode


def test_zlab_legacy_top_level_fields_load(tmp_path):
    config = zlab_config(dflash_config=None, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2])
    drafter = load_dflash(write_zlab(tmp_path / "old", config=config))
    assert drafter.config.mask_token_id == VOCAB - 1 and drafter.config.target_layer_ids == [0, 2]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.1.self_attn.k_norm.weight"), r"missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"),
    (lambda t: t.update({"fc.weight": torch.zeros(ZH, 3 * ZH)}), r"tensor 'fc\.weight' has shape \[32, 96\]"),
    (lambda t: t.update({"embed_tokens.weight": torch.zeros(VOCAB, ZH)}),
     r"unexpected tensor 'embed_tokens\.weight'.*target's embedding"),
])
def test_zlab_malformed_checkpoint_names_the_key(tmp_path, edit, message):
    tensors = zlab_tensors()
    edit(tensors)
    with pytest.raises(CheckpointError, match=message):
        load_dflash(write_zlab(tmp_path / "bad", tensors=tensors))


# ---------------------------------------------------------------------------------- transformers' chain-DFlash path


def test_transformers_chain_dflash_path_runs_our_drafter(zlab_dir):
    """target.generate(assistant_model=..., speculation_type="dflash") with our drafter: lossless, and every draft it
    asks for equals our drafter's own (cache-free) forward over the same committed context."""
    target = tiny_qwen3()
    drafter = load_dflash(zlab_dir).float()
    assistant = to_transformers_assistant(drafter)
    calls = []
    forward = assistant.forward

    def recording(**kwargs):
        out = forward(**kwargs)
        calls.append((kwargs["position_ids"].clone(), out.last_hidden_state.detach().clone()))
        return out

    assistant.forward = recording
    ids = prompts()[1]
    expected = reference(target, ids, 30)
    got = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant,
                          speculation_type="dflash", do_sample=False, max_new_tokens=30, min_new_tokens=0,
                          pad_token_id=0)
    assert torch.equal(got, expected)
    assert len(calls) >= 3
    embed = target.get_input_embeddings()
    with torch.no_grad():
        for positions, hidden in calls:
            n = int(positions[0, -ZBLOCK])  # first block position = the bonus token's
            states = target(got[:, :n], output_hidden_states=True).hidden_states
            context = drafter.extract_context_features(states)
            block = drafter.block_embeddings(got[0, n:n + 1], embed)
            mine = drafter(block, context, torch.arange(n + ZBLOCK)[None])
            torch.testing.assert_close(hidden, mine, atol=1e-4, rtol=1e-4)


def test_transformers_path_refuses_learned_mask_drafter():
    config = DFlashConfig.from_target_config(tiny_llama().config, num_hidden_layers=1, target_layer_ids=[0])
    with pytest.raises(ValueError, match="mask_token_id"):
        to_transformers_assistant(DFlashDraftModel(config))


# ------------------------------------------------------------------------------------------- Weaver .pth (Variant B)

WCFG = {"d_model": 48, "d_embed": 40, "d_rank": 32, "num_layers": 2, "num_heads": 4, "mlp_dim": 24, "K": 7,
        "candidate_pool_size": 16}


def released_state_dict(cfg=WCFG, seed=0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The release's key names and shapes (docs/DESIGN.md §3), written out by hand."""
    dm, de, dr, mlp = cfg["d_model"], cfg["d_embed"], cfg["d_rank"], cfg["mlp_dim"]
    shapes = {"output_norm.weight": (dm,), "output_norm.bias": (dm,), "embed_norm.weight": (de,),
              "embed_norm.bias": (de,), "token_in.weight": (dr, de), "token_in.bias": (dr,),
              "proposal_in.weight": (dr, dm), "proposal_in.bias": (dr,), "out_norm.weight": (dr,),
              "out_norm.bias": (dr,), "lm_head_query_in.weight": (dm, dr)}
    for i in range(cfg["num_layers"]):
        b = f"blocks.{i}."
        shapes |= {b + "norm_attn.weight": (dr,), b + "norm_attn.bias": (dr,), b + "qkv_proj.weight": (3 * dr, dr),
                   b + "o_proj.weight": (dr, dr), b + "norm_mlp.weight": (dr,), b + "norm_mlp.bias": (dr,),
                   b + "gate_up_proj.weight": (2 * mlp, dr), b + "gate_up_proj.bias": (2 * mlp,),
                   b + "down_proj.weight": (dr, mlp), b + "down_proj.bias": (dr,)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        if key.endswith("bias"):
            value = 0.1 * noise
        elif len(shape) == 1:
            value = 1 + 0.1 * noise
        else:
            value = noise / shape[-1] ** 0.5
        out[key] = value.to(dtype)
    return out


def save_pth(path: Path, config: dict, state: dict) -> Path:
    torch.save({"config": config, "state_dict": state}, path)
    return path


def reference_weaver(state, cfg, u0, draft_hidden, token_embeds, rope_base=10000.0, eps=1e-6):
    """An independent functional Weaver from the raw tensors, float64: the prompt and the teacher-forced chain as one
    causal pass over [prompt (positions 0..P-1) | nodes (positions 1..T)]; returns lm-head queries of the nodes."""
    w = {k: v.double() for k, v in state.items()}
    heads, d = cfg["num_heads"], cfg["d_rank"]
    hd = d // heads

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[name + ".weight"] + w[name + ".bias"]

    def rope(x, pos):  # [L, heads, hd]
        inv = rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos.double()[:, None] * inv
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    feats = torch.cat([u0[None], draft_hidden[: cfg["K"]]]).double()
    prompt = norm(feats, "output_norm") @ w["proposal_in.weight"].T + w["proposal_in.bias"]
    nodes = norm(token_embeds.double(), "embed_norm") @ w["token_in.weight"].T + w["token_in.bias"]
    x = torch.cat([prompt, nodes])
    p, t = prompt.shape[0], nodes.shape[0]
    pos = torch.cat([torch.arange(p), torch.arange(t) + 1])
    causal = torch.ones(p + t, p + t, dtype=torch.bool).tril()
    for i in range(cfg["num_layers"]):
        b = f"blocks.{i}."
        q, k, v = (norm(x, b + "norm_attn") @ w[b + "qkv_proj.weight"].T).view(p + t, 3, heads, hd).unbind(1)
        q, k = rope(q, pos), rope(k, pos)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", attn, v).reshape(p + t, d) @ w[b + "o_proj.weight"].T
        gate, up = (norm(x, b + "norm_mlp") @ w[b + "gate_up_proj.weight"].T + w[b + "gate_up_proj.bias"]).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[b + "down_proj.weight"].T + w[b + "down_proj.bias"]
    return norm(x[p:], "out_norm") @ w["lm_head_query_in.weight"].T


@pytest.mark.parametrize("extra", [{}, {"rope_base": 5000.0, "encoder_mode": 3, "score_head": 4,
                                        "activation": "swiglu"}])
def test_weaver_pth_converts_to_identical_outputs(tmp_path, extra):
    cfg = {**WCFG, **extra}
    state = released_state_dict()
    out = convert_weaver(save_pth(tmp_path / "weaver.pth", cfg, state), tmp_path / "hub")

    saved = json.loads((out / "config.json").read_text())
    for field in ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K", "candidate_pool_size"):
        assert saved[field] == cfg[field], field
    assert saved["rope_base"] == cfg.get("rope_base", 10000.0)
    assert saved["auto_map"]["AutoModel"] == "modeling_weaver.WeaverModel"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # tensors stored unchanged (bf16)
        assert set(f.keys()) == set(state)
        assert all(torch.equal(f.get_tensor(k), state[k]) for k in state)

    model = AutoModel.from_pretrained(out, trust_remote_code=True).float().eval()
    gen = torch.Generator().manual_seed(1)
    u0, dh = torch.randn(48, generator=gen), torch.randn(6, 48, generator=gen)
    embeds = torch.randn(5, 40, generator=gen)
    expected = reference_weaver(state, cfg, u0, dh, embeds, rope_base=cfg.get("rope_base", 10000.0))
    with torch.no_grad():
        got = model(u0[None], dh[None], embeds[None])[0]
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)

    # candidate logits read only the pool rows of the target lm_head: dflash logit + E_lm[c] · query
    lm_head = torch.randn(VOCAB, 48, generator=gen)
    pool = torch.randperm(VOCAB, generator=gen)[:16]
    pool_logits = torch.randn(16, generator=gen)
    logits = WeaverModel.candidate_logits(got[2], pool, pool_logits, lm_head)
    torch.testing.assert_close(logits.double(), pool_logits.double() + lm_head[pool].double() @ expected[2],
                               atol=1e-4, rtol=1e-4)
    assert load_weaver(tmp_path / "weaver.pth").dtype == torch.bfloat16  # the .pth loads directly too


def test_weaver_released_checkpoint_is_lossless_in_the_loop(tmp_path):
    target = tiny_llama()
    drafter = DFlashDraftModel(DFlashConfig.from_target_config(target.config, num_hidden_layers=1, block_size=6,
                                                               target_layer_ids=[1])).eval()
    cfg = {**WCFG, "d_model": 32, "d_embed": 32, "K": 5}
    weaver = load_released_weaver(save_pth(tmp_path / "w.pth", cfg, released_state_dict(cfg)), dtype="fp32")
    ids = prompts()[1]
    got = speculative_generate(target, ids, drafter=drafter, weaver=weaver, tree_budget=10, max_new_tokens=24)
    assert torch.equal(got, reference(target, ids, 24))


def _bad(cfg=None, edit=None):
    cfg = dict(WCFG if cfg is None else cfg)
    state = released_state_dict()
    if edit:
        edit(cfg, state)
    return {"config": cfg, "state_dict": state}


@pytest.mark.parametrize("payload, message", [
    (_bad(edit=lambda c, s: s.pop("blocks.1.norm_mlp.bias")), r"missing tensor 'blocks\.1\.norm_mlp\.bias'"),
    (_bad(edit=lambda c, s: s.update({"proposal_in.weight": torch.zeros(32, 40)})),
     r"tensor 'proposal_in\.weight' has shape \[32, 40\], the config implies \[32, 48\]"),
    (_bad(edit=lambda c, s: s.update({"blocks.0.extra.weight": torch.zeros(3)})), r"unexpected tensor 'blocks\.0\."
                                                                                   r"extra\.weight'"),
    (_bad(edit=lambda c, s: c.pop("mlp_dim")), r"config field 'mlp_dim' is missing"),
    (_bad(edit=lambda c, s: c.update({"use_moe": True})), r"unrecognised config field 'use_moe'"),
    (_bad(edit=lambda c, s: c.update({"score_head": 2})), r"'score_head' = 2.*variant"),
    (_bad(edit=lambda c, s: c.update({"activation": "gelu"})), r"older Weaver variant"),
    ({"state_dict": {}}, r"expected a dict with keys 'config' and 'state_dict'"),
])
def test_malformed_weaver_pth_names_the_problem(tmp_path, payload, message):
    with pytest.raises(CheckpointError, match=message):
        read_released_weaver(payload)


def test_older_weaver_variant_is_refused_by_name(tmp_path):
    """Separate q/k/v projections, GELU fc1/fc2 MLP, learned pos_emb: a different computation, refused by name."""
    state = released_state_dict()
    for i in range(WCFG["num_layers"]):
        qkv = state.pop(f"blocks.{i}.qkv_proj.weight")
        for name, part in zip(("q_proj", "k_proj", "v_proj"), qkv.chunk(3)):
            state[f"blocks.{i}.{name}.weight"] = part
        state[f"blocks.{i}.fc1.weight"] = state.pop(f"blocks.{i}.gate_up_proj.weight")[:24]
        state[f"blocks.{i}.fc2.weight"] = state.pop(f"blocks.{i}.down_proj.weight")
    state["pos_emb"] = torch.zeros(WCFG["K"], WCFG["d_rank"])
    path = save_pth(tmp_path / "old.pth", WCFG, state)
    with pytest.raises(CheckpointError, match=r"older Weaver variant .*found 'blocks\.0\.fc1\.weight'"):
        convert_weaver(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------------------- hub_configs


def qwen3_6_27b_text():
    """Qwen3.6-27B's text config at docs/DESIGN.md §7 numbers (built here, independently of the package)."""
    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )


def smollm2_135m():
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


def test_hub_configs_are_in_sync_with_the_package():
    stale = sync_hub_configs(check=True)
    assert not stale, f"hub_configs/ out of sync ({stale[:3]}...): run `weaver export --hub-configs`"
    for name in HUB_SPECS:
        folder = ROOT / "hub_configs" / name
        for copied in (*folder.glob("*.py"), *folder.glob("dflash/*.py"), *folder.glob("weaver/*.py")):
            source = f"modeling_weaver/{copied.name}"
            assert copied.read_text(encoding="utf-8") == generated_copy(source), copied
        for file in ("generate.py", "requirements.txt"):
            source = f"custom_generate/{file}"
            assert (folder / source).read_text(encoding="utf-8") == generated_copy(source)


def generated_copy(source: str) -> str:
    """What a Hub copy of ``source`` (relative to the checkout) must hold: the do-not-edit line, then the source."""
    banner = f"# Generated from {source} — do not edit; edit the source and run `weaver export`.\n"
    return banner + (ROOT / source).read_text(encoding="utf-8")


def test_banner_is_added_once():
    text = (ROOT / "modeling_weaver" / "configuration_weaver.py").read_text(encoding="utf-8")
    once = with_banner(text, "modeling_weaver/configuration_weaver.py")
    assert once == generated_copy("modeling_weaver/configuration_weaver.py")
    assert with_banner(once, "modeling_weaver/configuration_weaver.py") == once  # a copy of a copy: one banner
    compile(once, "configuration_weaver.py", "exec")  # a comment may precede `from __future__`


def _load(folder: Path, meta: bool):
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert type(config).__module__.startswith("transformers_modules")  # the folder's own code
    if meta:
        with torch.device("meta"):
            return config, AutoModel.from_config(config, trust_remote_code=True)
    return config, AutoModel.from_config(config, trust_remote_code=True)


@pytest.mark.parametrize("name", ["qwen3.6-27b", "qwen3.5-27b"])
def test_27b_hub_configs_load_and_pair_with_qwen3_6_27b(name):
    folder = ROOT / "hub_configs" / name
    dflash, drafter = _load(folder / "dflash", meta=True)
    weaver_config, weaver = _load(folder / "weaver", meta=True)
    assert dflash.num_hidden_layers == 5 and dflash.block_size == 16 and dflash.mask_token_id == 248070
    assert dflash.target_layer_ids == [1, 16, 31, 46, 61] and dflash.num_target_layers == 64
    assert (dflash.num_attention_heads, dflash.num_key_value_heads, dflash.head_dim) == (32, 8, 128)
    # z-lab's 27B drafters are 3.22 GiB of bf16 safetensors; this shape is exactly that size
    params = sum(p.numel() for p in drafter.parameters())
    assert round(params * 2 / 2**30, 2) == 3.22
    sliding = dflash.layer_types.count("sliding_attention")
    assert (sliding, dflash.sliding_window) == ((4, 2048) if name == "qwen3.6-27b" else (0, None))
    assert (weaver_config.d_rank, weaver_config.num_layers, weaver_config.candidate_pool_size,
            weaver_config.mlp_dim, weaver_config.num_heads, weaver_config.K) == (2048, 1, 512, 1368, 16, 15)
    assert round(sum(p.numel() for p in weaver.parameters()) / 1e6, 1) == 56.7

    target = qwen3_6_27b_text()
    assert target.layer_types.count("linear_attention") == 48
    check_pair(target, dflash, weaver_config)
    check_pair(Qwen3_5Config(text_config=target.to_dict()), dflash, weaver_config)  # the multimodal wrapper
    spec = json.loads((folder / "speculative_config.json").read_text())
    assert spec["target_config"]["hidden_size"] == 5120 and spec["generation_defaults"]["mode"] == "weaver"


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_hybrid_moe_hub_configs_load_and_pair_with_their_targets(name):
    from transformers import Qwen3_5MoeConfig

    folder = ROOT / "hub_configs" / name
    dflash, _ = _load(folder / "dflash", meta=True)
    weaver_config, _ = _load(folder / "weaver", meta=True)
    target = HUB_SPECS[name].target()
    layers = {"qwen3.5-35b-a3b": 40, "qwen3-next-80b-a3b": 48}[name]
    assert target.num_experts_per_tok > 1 and target.layer_types.count("full_attention") == layers // 4
    assert dflash.hidden_size == weaver_config.d_model == 2048 and dflash.num_target_layers == layers
    check_pair(target, dflash, weaver_config)
    if name == "qwen3.5-35b-a3b":
        check_pair(Qwen3_5MoeConfig(text_config=target.to_dict()), dflash, weaver_config)  # the multimodal wrapper
    spec = json.loads((folder / "speculative_config.json").read_text())
    assert spec["target_config"]["model_type"] == target.model_type


def test_kimi_linear_hub_config_loads_and_pairs():
    """Kimi Linear 48B-A3B: KDA and MLA layers 3:1 in the spec's target; the drafter's heads 32 × 72 (hidden / heads,
    not MLA's 64 RoPE dims), a learned mask embedding; pairs with the published sizes built in transformers' class."""
    from test_models import kimi_linear_48b_a3b

    folder = ROOT / "hub_configs" / "kimi-linear-48b-a3b"
    dflash, drafter = _load(folder / "dflash", meta=True)
    weaver_config, _ = _load(folder / "weaver", meta=True)
    target = HUB_SPECS["kimi-linear-48b-a3b"].target()
    assert target.layer_types.count("full_attention") == 7 and target.layer_types[3] == "full_attention"
    assert target.layer_types[-1] == "full_attention" and target.mlp_layer_types.count("dense") == 1
    assert (dflash.num_attention_heads, dflash.num_key_value_heads, dflash.head_dim) == (32, 32, 72)
    assert dflash.mask_token_id is None and drafter.mask_embedding is not None
    assert dflash.num_target_layers == 27 and dflash.hidden_size == weaver_config.d_model == 2304
    check_pair(target, dflash, weaver_config)
    check_pair(kimi_linear_48b_a3b(), dflash, weaver_config)
    spec = json.loads((folder / "speculative_config.json").read_text())
    assert spec["target_config"]["model_type"] == "kimi_linear" and spec["target_config"]["vocab_size"] == 163840


def test_qwen3_6_hub_config_takes_zlab_weights_unchanged():
    """A z-lab-format Qwen3.6-27B drafter config (their spellings) implies exactly our folder's tensor shapes."""
    from modeling_weaver.convert import _expected_shapes

    zlab = DFlashConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": 16, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 248320, "num_target_layers": 64, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_theta": 10000000, "sliding_window": 2048, "use_sliding_window": True,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    })
    ours = AutoConfig.from_pretrained(ROOT / "hub_configs" / "qwen3.6-27b" / "dflash", trust_remote_code=True)
    assert _expected_shapes(DFlashDraftModel, zlab) == _expected_shapes(DFlashDraftModel, ours)
    for key in ("layer_types", "sliding_window", "block_size", "target_layer_ids", "mask_token_id"):
        assert getattr(zlab, key) == getattr(ours, key), key
    assert zlab.rope_parameters["rope_theta"] == ours.rope_parameters["rope_theta"] == 1e7


def test_smollm2_hub_config_loads_and_pairs():
    folder = ROOT / "hub_configs" / "smollm2-135m-instruct"
    dflash, drafter = _load(folder / "dflash", meta=False)
    weaver_config, weaver = _load(folder / "weaver", meta=False)
    assert dflash.mask_token_id is None and drafter.mask_embedding is not None  # no mask token in the vocabulary
    assert dflash.hidden_size == 576 and dflash.vocab_size == 49152
    check_pair(smollm2_135m(), dflash, weaver_config)
    check_pair(smollm2_135m(), drafter, weaver)  # models work too


def test_mismatched_pairs_are_refused():
    qwen = ROOT / "hub_configs" / "qwen3.6-27b"
    smol = ROOT / "hub_configs" / "smollm2-135m-instruct"
    q_dflash = AutoConfig.from_pretrained(qwen / "dflash", trust_remote_code=True)
    q_weaver = AutoConfig.from_pretrained(qwen / "weaver", trust_remote_code=True)
    s_dflash = AutoConfig.from_pretrained(smol / "dflash", trust_remote_code=True)
    s_weaver = AutoConfig.from_pretrained(smol / "weaver", trust_remote_code=True)
    big, small = qwen3_6_27b_text(), smollm2_135m()
    with pytest.raises(PairingError, match="drafter hidden_size 5120 does not match the target's 576"):
        check_pair(small, q_dflash, q_weaver)
    with pytest.raises(PairingError, match="drafter hidden_size 576 does not match the target's 5120"):
        check_pair(big, s_dflash)
    with pytest.raises(PairingError, match="weaver d_model 576 does not match the target's hidden size 5120"):
        check_pair(big, q_dflash, s_weaver)
    qwen3_8b_like = Qwen3_5TextConfig(**{**big.to_dict(), "num_hidden_layers": 36, "layer_types": None})
    with pytest.raises(PairingError, match=r"target_layer_ids \[46, 61\] do not exist in the target \(36 layers\)"):
        check_pair(qwen3_8b_like, q_dflash)
    with pytest.raises(PairingError, match="built for a 64-layer target"):
        check_pair(Qwen3_5TextConfig(**{**big.to_dict(), "num_hidden_layers": 80, "layer_types": None}), q_dflash)
    with pytest.raises(PairingError, match="vocab_size 248320 does not match the target's lm_head"):
        check_pair(big, q_dflash, target_vocab_size=151936)
    with pytest.raises(PairingError, match="weaver d_embed 5120 does not match the target's embedding width 4096"):
        check_pair(big, q_dflash, q_weaver, target_embed_dim=4096)


# ------------------------------------------------------------------------------------ custom_generate + export + card


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    target = tiny_llama()
    dconfig = DFlashConfig.from_target_config(target.config, num_hidden_layers=2, block_size=8,
                                              target_layer_ids=[0, 1])
    drafter = DFlashDraftModel(dconfig).eval()
    weaver = WeaverModel(WeaverConfig.from_target_config(target.config, dconfig, d_rank=32, num_heads=4, mlp_dim=64,
                                                         candidate_pool_size=16)).eval()
    out = export_pair(tmp_path_factory.mktemp("export") / "tiny-llama-weaver", drafter, weaver,
                      target_config=target.config, target_name="tiny/llama", tree_budget=16,
                      card={"results_command": "weaver bench --tiny", "dflash_training_data": "none (random)"})
    return target, drafter, weaver, out


def test_export_writes_a_complete_repo(exported):
    target, drafter, weaver, out = exported
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    for name in ("README.md", "speculative_config.json", "custom_generate/generate.py",
                 "custom_generate/requirements.txt", "dflash/config.json", "dflash/model.safetensors",
                 "dflash/modeling_dflash.py", "dflash/configuration_dflash.py", "weaver/config.json",
                 "weaver/model.safetensors", "weaver/modeling_weaver.py", "weaver/configuration_weaver.py"):
        assert name in files, name
    for name in files:  # every code copy carries one do-not-edit line naming its source
        if name.endswith((".py", ".txt")):
            source = f"custom_generate/{name.rpartition('/')[2]}" if name.startswith("custom_generate/") \
                else f"modeling_weaver/{name.rpartition('/')[2]}"
            assert (out / name).read_text(encoding="utf-8") == generated_copy(source), name
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0") and "base_model: tiny/llama" in card
    assert "weaver bench --tiny" in card and "**[TO FILL: results_table]**" in card and "{{" not in card
    assert "template-note" not in card
    loaded = AutoModel.from_pretrained(out, subfolder="dflash", trust_remote_code=True)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    with pytest.raises(FileExistsError):
        export_pair(out, drafter, weaver, target_config=target.config, target_name="tiny/llama")
    with pytest.raises(PairingError):
        export_pair(out.parent / "wrong", drafter, weaver, target_config=tiny_qwen3(vocab=VOCAB + 1).config,
                    target_name="x")


def test_custom_generate_folder_matches_speculative_generate(exported, monkeypatch):
    target, drafter, weaver, out = exported
    ids = prompts()[1]
    expected = reference(target, ids, 20)
    for mode in ("weaver", "ddtree", "chain"):
        direct = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode=mode, tree_budget=10,
                                      max_new_tokens=20)
        via_hub = target.generate(ids, custom_generate=str(out), trust_remote_code=True, drafter=drafter,
                                  weaver=weaver, mode=mode, tree_budget=10, max_new_tokens=20, do_sample=False)
        assert torch.equal(via_hub, direct) and torch.equal(direct, expected), mode
    # drafters given as the repo folder: loaded from dflash/ and weaver/, generation defaults from
    # speculative_config.json (tree_budget 16; no mode written: the device's, DDTree on a CPU)
    from modeling_weaver.decoding import loop

    direct = speculative_generate(target, ids, drafter=drafter, weaver=weaver, mode="ddtree", tree_budget=16,
                                  max_new_tokens=20)
    seen, real = [], loop.plan_steps
    monkeypatch.setattr(loop, "plan_steps", lambda *a, **k: seen.append((k["mode"], k["tree_budget"])) or real(*a, **k))
    by_path = target.generate(ids, custom_generate=str(out), trust_remote_code=True, drafter=str(out),
                              weaver=str(out), max_new_tokens=20, do_sample=False)
    monkeypatch.setattr(loop, "plan_steps", real)
    assert torch.equal(by_path, direct) and seen == [("ddtree", 16)]
    # the source checkout itself is a custom_generate repo (top-level custom_generate/)
    at_root = target.generate(ids, custom_generate=str(ROOT), trust_remote_code=True, drafter=drafter,
                              weaver=weaver, mode="chain", max_new_tokens=20, do_sample=False)
    assert torch.equal(at_root, expected)
    # a streamer given to generate() reaches our loop through the Hub recipe: prompt, every token, end()
    chunks, ended = [], []
    streamer = type("S", (), {"put": lambda self, v: chunks.append(v.reshape(-1).tolist()),
                              "end": lambda self: ended.append(True)})()
    streamed = target.generate(ids, custom_generate=str(out), trust_remote_code=True, drafter=drafter,
                               weaver=weaver, max_new_tokens=20, do_sample=False, streamer=streamer)
    assert sum(chunks, []) == streamed[0].tolist() and chunks[0] == ids[0].tolist() and ended == [True]


def test_render_card_marks_missing_fields():
    text = render_card({"a": 1, "b": ""}, template="x {{a}} y {{ b }} z {{c}}")
    assert text == "x 1 y **[TO FILL: b]** z **[TO FILL: c]**"
    full = render_card({})
    for section in ("## Intended use", "## Target model and pairing", "## Training", "## Measured results",
                    "## Limitations", "## Licence", "Batch size 1"):
        assert section.lower() in full.lower(), section
