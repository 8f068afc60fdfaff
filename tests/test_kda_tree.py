"""Tree Kimi Delta Attention references (``weaver_kernels.kda_tree.naive``, docs/DESIGN.md §13) against the
token-by-token recurrence along each node's root path, in fp64; the recurrence against transformers' own KDA."""

from __future__ import annotations

import random
import warnings
from types import SimpleNamespace

import pytest
import torch

from weaver_kernels.gdn_tree.naive import gdn_tree_commit_ref, gdn_tree_verify_ref
from weaver_kernels.kda_tree.naive import kda_gates, kda_recurrent_ref, kda_tree_commit_ref, kda_tree_verify_ref
from weaver_kernels.testing import (
    ancestor_mask,
    best_first_parents,
    chain_parents,
    deep_path_parents,
    depths,
    forest_parents,
    kda_inputs,
    path_to,
    random_parents,
    shuffled_topological,
    star_parents,
)

F64 = torch.float64
EXACT = 1e-12  # fp64: the solve and the recurrence agree to rounding


def _tree(kind: str, T: int, rng: random.Random) -> list[int]:
    return {
        "chain": lambda: chain_parents(T),
        "star": lambda: star_parents(T),
        "deep": lambda: deep_path_parents(T, rng),
        "random": lambda: random_parents(T, rng),
        "forest": lambda: forest_parents(T, rng),
        "shuffled": lambda: shuffled_topological(best_first_parents(T, rng), rng),
    }[kind]()


def _path_errors(parents, q, k, v, g, beta, S0, o, u, gamma, l2, nodes=None):
    """Max |tree − recurrence| over the outputs of each node's root path and over the state committed at that node."""
    err_o = err_s = 0.0
    for i in range(len(parents)) if nodes is None else nodes:
        p = torch.tensor(path_to(parents, i))
        ro, rS = kda_recurrent_ref(q[:, p], k[:, p], v[:, p], g[:, p], beta[:, p], S0, use_qk_l2norm_in_kernel=l2)
        err_o = max(err_o, (o[:, p] - ro).abs().max().item())
        S = kda_tree_commit_ref(S0.clone(), k, u, gamma, p, use_qk_l2norm_in_kernel=l2)
        err_s = max(err_s, (S - rS).abs().max().item())
    return err_o, err_s


@pytest.mark.parametrize("kind", ["chain", "star", "deep", "random", "forest", "shuffled"])
@pytest.mark.parametrize("H,HV,l2", [(2, 4, True), (3, 3, False)])
def test_tree_equals_recurrence_on_every_root_path(kind, H, HV, l2):
    T = 24
    parents = _tree(kind, T, random.Random(T + HV))
    q, k, v, g, beta, S0 = kda_inputs(2, T, H, HV, 8, 6, F64, seed=HV, l2norm_in_kernel=l2)
    o, u, gamma = kda_tree_verify_ref(q, k, v, g, beta, S0, ancestor_mask(parents), use_qk_l2norm_in_kernel=l2)
    assert o.shape == v.shape and u.shape == v.shape and gamma.shape == g.shape
    err_o, err_s = _path_errors(parents, q, k, v, g, beta, S0, o, u, gamma, l2)
    assert err_o <= EXACT and err_s <= EXACT, (err_o, err_s)


def test_commit_of_a_random_accepted_path_equals_sequential_decoding():
    """The state committed from the verify's u and gamma along a random root→node path (right-padded with −1, as
    fixed-shape steps pass it) equals decoding that path token by token; an all-padding path changes nothing."""
    rng = random.Random(7)
    parents = deep_path_parents(40, rng, depth=15)
    q, k, v, g, beta, S0 = kda_inputs(2, 40, 2, 4, 16, 8, F64, seed=3)
    o, u, gamma = kda_tree_verify_ref(q, k, v, g, beta, S0, ancestor_mask(parents), use_qk_l2norm_in_kernel=True)
    for leaf in rng.sample(range(40), 5):
        pp = path_to(parents, leaf)
        S = S0.clone()
        out = kda_tree_commit_ref(S, k, u, gamma, torch.tensor(pp + [-1] * 4), use_qk_l2norm_in_kernel=True)
        assert out is S  # in place
        _, rS = kda_recurrent_ref(q[:, pp], k[:, pp], v[:, pp], g[:, pp], beta[:, pp], S0, use_qk_l2norm_in_kernel=True)
        assert (S - rS).abs().max().item() <= EXACT
    S = S0.clone()
    kda_tree_commit_ref(S, k, u, gamma, torch.full((3,), -1), use_qk_l2norm_in_kernel=True)
    assert torch.equal(S, S0)


def test_forgetting_channels_do_not_overflow_off_path():
    """A channel that forgets everything (g = −1000 at some nodes) puts Γ_i − Γ_j ≈ +1000 between branches: exp of
    that is inf even in fp64, so the masking must come before the exp; the tree still equals the recurrence."""
    parents = random_parents(20, random.Random(5))
    q, k, v, g, beta, S0 = kda_inputs(1, 20, 2, 2, 8, 4, F64, seed=11)
    g[:, 3::4, :, 0] = -1000.0
    o, u, gamma = kda_tree_verify_ref(q, k, v, g, beta, S0, ancestor_mask(parents), use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and torch.isfinite(u).all()
    err_o, err_s = _path_errors(parents, q, k, v, g, beta, S0, o, u, gamma, True)
    assert err_o <= EXACT and err_s <= EXACT, (err_o, err_s)


def test_scalar_gate_gives_the_gdn_tree():
    """With the same decay in every channel, KDA is §5's gated delta rule: the GDN references give the same result."""
    parents = random_parents(16, random.Random(2))
    q, k, v, g, beta, S0 = kda_inputs(2, 16, 2, 4, 8, 6, F64, seed=4)
    g1 = g[..., 0]
    M = ancestor_mask(parents)
    o, u, gamma = kda_tree_verify_ref(q, k, v, g1[..., None].expand_as(g), beta, S0, M, use_qk_l2norm_in_kernel=True)
    go, gu, ggamma = gdn_tree_verify_ref(q, k, v, g1, beta, S0, M, use_qk_l2norm_in_kernel=True)
    assert (o - go).abs().max() <= EXACT and (u - gu).abs().max() <= EXACT
    assert (gamma - ggamma[..., None]).abs().max() <= EXACT
    path = torch.tensor(path_to(parents, 15))
    S = kda_tree_commit_ref(S0.clone(), k, u, gamma, path, True)
    assert (S - gdn_tree_commit_ref(S0.clone(), k, gu, ggamma, path, True)).abs().max() <= EXACT


def test_negative_controls_fail_the_check():
    """The check can fail: a mask missing one ancestor edge, one perturbed gate channel, or a decay averaged over the
    channels (a GDN-like scalar gate) each leave errors far above the tolerance."""
    parents = deep_path_parents(20, random.Random(9), depth=10)
    q, k, v, g, beta, S0 = kda_inputs(1, 20, 2, 2, 8, 4, F64, seed=5)
    M = ancestor_mask(parents)
    deep = max(range(20), key=lambda i: depths(parents)[i])
    leaf_only = [deep]

    def errs(mask=M, gate=g):
        o, u, gamma = kda_tree_verify_ref(q, k, v, gate, beta, S0, mask, use_qk_l2norm_in_kernel=True)
        return _path_errors(parents, q, k, v, g, beta, S0, o, u, gamma, True, nodes=leaf_only)

    assert max(errs()) <= EXACT
    wrong = M.clone()
    wrong[deep, parents[parents[deep]]] = False  # the grandparent edge: no longer transitively closed
    assert min(errs(mask=wrong)) > 1e-4
    nudged = g.clone()
    nudged[:, parents[deep], :, 3] += 0.5
    assert min(errs(gate=nudged)) > 1e-4
    assert min(errs(gate=g.mean(-1, keepdim=True).expand_as(g))) > 1e-4


def test_raw_gates_match_precomputed_gates():
    """``A_log``/``dt_bias`` make verify form the gates itself from the raw projections (as ``kda_gates``)."""
    B, T, H, K = 1, 10, 2, 8
    parents = random_parents(T, random.Random(3))
    q, k, v, _, _, S0 = kda_inputs(B, T, H, H, K, 4, F64, seed=6)
    gen = torch.Generator().manual_seed(1)
    f = torch.randn(B, T, H, K, generator=gen, dtype=F64) * 10
    b = torch.randn(B, T, H, generator=gen, dtype=F64)
    A_log, dt_bias = torch.randn(1, 1, H, 1, dtype=F64, generator=gen), torch.randn(H * K, dtype=F64, generator=gen)
    M = ancestor_mask(parents)
    got = kda_tree_verify_ref(q, k, v, f, b, S0, M, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    g, beta = kda_gates(f, b, A_log, dt_bias)
    want = kda_tree_verify_ref(q, k, v, g, beta, S0, M, use_qk_l2norm_in_kernel=True)
    for a, w in zip(got, want):
        assert torch.equal(a, w)


# ----------------------------------------------------------------------------------------------- transformers
@pytest.fixture(scope="module")
def kimi():
    return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def test_gates_equal_transformers_forget_gate(kimi):
    """``kda_gates`` on the raw projections equals KimiLinear's forget gate bit for bit (softplus both sides of 20)."""
    H, K, hidden = 3, 8, 16
    gate = kimi.KimiLinearForgetGate(SimpleNamespace(linear_head_dim=K, linear_num_heads=H, hidden_size=hidden))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 3)
    x = torch.randn(2, 5, hidden, generator=gen)
    f = gate.f_b_proj(gate.f_a_proj(x)).view(2, 5, H, K)
    assert (f + gate.dt_bias.view(H, K) > 20).any() and (f + gate.dt_bias.view(H, K) < -20).any()
    b = torch.randn(2, 5, H, generator=gen)
    g, beta = kda_gates(f, b, gate.A_log, gate.dt_bias)
    assert g.dtype == torch.float32 and torch.equal(g, gate(x))
    assert torch.equal(beta, torch.sigmoid(b))


def test_recurrence_equals_transformers_kda(kimi):
    """The ground truth is the model's: ``kda_recurrent_ref`` against transformers' torch KDA (its recurrent form,
    the decoding path, and its chunked form, the prefill path), which compute in fp32."""
    B, T, H, K, V = 2, 20, 3, 16, 16
    q, k, v, g, beta, S0 = kda_inputs(B, T, H, H, K, V, torch.float32, seed=8)
    kw = dict(use_qk_l2norm_in_kernel=True)
    ro, rS = kda_recurrent_ref(q, k, v, g, beta, S0, **kw)
    o64, S64 = kda_recurrent_ref(*(t.double() for t in (q, k, v, g, beta, S0)), **kw)
    to, tS = kimi.recurrent_kimi_delta_attention(q, k, v, g, beta, S0.clone(), True, **kw)
    co, cS = kimi.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=8, initial_state=S0.clone(),
                                             output_final_state=True, **kw)
    for o, S, tol in ((to, tS, 1e-6), (co, cS, 1e-6), (o64, S64, 1e-5)):
        assert (o.double() - ro.double()).abs().max() <= tol and (S.double() - rS.double()).abs().max() <= tol


# ------------------------------------------------------------------------------------------------ custom ops
def test_custom_ops_run_the_references():
    """``weaver::kda_tree_verify`` / ``kda_tree_commit``: the references' results (direct CPU call and through the
    dispatcher), fake implementations and in-place commit checked by ``opcheck``."""
    import weaver_kernels as wk

    parents = forest_parents(7, random.Random(0), roots=2)
    q, k, v, g, beta, S0 = kda_inputs(1, 7, 1, 2, 16, 16, torch.float32, seed=1)
    M = ancestor_mask(parents)
    path = torch.tensor(path_to(parents, 6) + [-1])
    want = kda_tree_verify_ref(q, k, v, g, beta, S0, M, use_qk_l2norm_in_kernel=True)
    got = wk.kda_tree_verify(q, k, v, g, beta, S0, M, use_qk_l2norm_in_kernel=True)
    traced = torch.ops.weaver.kda_tree_verify(q, k, v, g, beta, S0, M, 16**-0.5, True, None, None)
    for a, b, w in zip(got, traced, want):
        assert torch.equal(a, w) and torch.equal(b, w)
    S = S0.clone()
    assert wk.kda_tree_commit(S, k, got[1], got[2], path, use_qk_l2norm_in_kernel=True) is S
    assert torch.equal(S, kda_tree_commit_ref(S0.clone(), k, want[1], want[2], path, True))
    with pytest.raises(ValueError, match="go together"):
        wk.kda_tree_verify(q, k, v, g, beta, S0, M, A_log=torch.zeros(2))

    torch.library.opcheck(torch.ops.weaver.kda_tree_verify.default, (q, k, v, g, beta, S0, M, 0.25, True, None, None))
    torch.library.opcheck(torch.ops.weaver.kda_tree_commit.default, (S0.clone(), k, got[1], got[2], path, True))


def test_decode_equals_a_one_node_verify_and_commit():
    """``weaver::kda_decode`` (the AR step) gives a one-node tree's output and committed state, token after token, with
    the gates formed from the raw projections or given; its fake implementation and in-place state pass ``opcheck``."""
    import weaver_kernels as wk

    B, T, H, K, V = 1, 4, 2, 8, 6
    q, k, v, _, _, S0 = kda_inputs(B, T, H, H, K, V, F64, seed=4)
    gen = torch.Generator().manual_seed(2)
    f, b = torch.randn(B, T, H, K, generator=gen, dtype=F64) * 3, torch.randn(B, T, H, generator=gen, dtype=F64)
    A_log, dt_bias = torch.randn(H, dtype=F64, generator=gen), torch.randn(H * K, dtype=F64, generator=gen)
    one, root = torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long)
    S_tree, S_dec, S_pre = S0.clone(), S0.clone(), S0.clone()
    for t in range(T):
        x = [a[:, t : t + 1] for a in (q, k, v, f, b)]
        o, u, gamma = kda_tree_verify_ref(*x, S_tree, one, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        kda_tree_commit_ref(S_tree, x[1], u, gamma, root, use_qk_l2norm_in_kernel=True)
        got = wk.kda_decode(*x, S_dec, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        g, beta = kda_gates(x[3], x[4], A_log, dt_bias)
        pre = wk.kda_decode(*x[:3], g, beta, S_pre, use_qk_l2norm_in_kernel=True)
        assert (got - o).abs().max() <= EXACT and (S_dec - S_tree).abs().max() <= EXACT, t
        assert torch.equal(pre, got) and torch.equal(S_pre, S_dec)
    assert not torch.equal(S_dec, S0)
    with pytest.raises(ValueError, match="go together"):
        wk.kda_decode(q[:, :1], k[:, :1], v[:, :1], f[:, :1], b[:, :1], S0, dt_bias=dt_bias)
    x = [a[:, :1].float() for a in (q, k, v, f, b)]
    torch.library.opcheck(torch.ops.weaver.kda_decode.default,
                          (*x, S0.float(), 0.3, True, A_log.float(), dt_bias.float()))


# -------------------------------------------------------------------------------------- Triton (interpreter)
@pytest.fixture(scope="module")
def ik():
    pytest.importorskip("triton")
    from weaver_kernels.utils import load_interpreted

    return SimpleNamespace(fused=load_interpreted("weaver_kernels.kda_tree.fused"),
                           neumann=load_interpreted("weaver_kernels.kda_tree.neumann"),
                           strip=load_interpreted("weaver_kernels.kda_tree.strip"),
                           commit=load_interpreted("weaver_kernels.kda_tree.commit"))


#: the verify's forms: the fused row-block solve, and the Neumann form (depth-many dense products)
FORMS = ("fused", "neumann", "strip")


def _verify(kernels, form):
    return getattr(getattr(kernels, form), {"fused": "kda_tree_verify_triton", "neumann": "kda_tree_verify_neumann",
                                            "strip": "kda_tree_verify_strip"}[form])


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item() if torch.isfinite(x).all() else float("inf")


KERNEL_CASES = [  # kind, T, H, HV, K, V, dtype, l2, BKC
    ("chain", 33, 1, 2, 16, 16, torch.float32, True, 16),
    ("deep", 37, 1, 1, 32, 24, torch.float32, False, 16),
    ("star", 20, 2, 2, 16, 16, torch.float32, True, 16),
    ("forest", 24, 1, 2, 40, 16, torch.float32, True, 32),
    ("shuffled", 30, 1, 1, 16, 8, torch.float32, True, 16),
    ("random", 18, 1, 2, 32, 16, torch.bfloat16, True, 32),
    ("star", 9, 1, 2, 16, 16, torch.float32, True, 16),  # one row block (the strip form's T ≤ 16 path)
    ("deep", 16, 1, 1, 32, 16, torch.bfloat16, False, 16),
]


def _case_id(c):
    return f"{c[0]}-T{c[1]}-H{c[2]}x{c[3]}-K{c[4]}V{c[5]}-{str(c[6])[6:]}-l2{int(c[7])}-BKC{c[8]}"


def _case_inputs(case, g_scale=1.0):
    """``(parents, (q, k, v, g, beta, S0))`` of a kernel case, the gates times ``g_scale``; g, β and S0 in fp32."""
    kind, T, H, HV, K, V, dtype, l2, _ = case
    q, k, v, g, beta, S0 = kda_inputs(1, T, H, HV, K, V, dtype, seed=T, l2norm_in_kernel=l2)
    return _tree(kind, T, random.Random(T)), (q, k, v, g.float() * g_scale, beta.float(), S0.float())


def _check_verify_and_commit(kernels, case, device="cpu", g_scale=1.0, form="fused"):
    """The Triton verify (of ``form``) and commit of ``case`` (its gates times ``g_scale``) against the fp64
    references (computed on the CPU); returns the verify's ``(o, u, gamma)``."""
    kind, T, H, HV, K, V, dtype, l2, BKC = case
    parents, (q, k, v, g, beta, S0) = _case_inputs(case, g_scale)
    M = ancestor_mask(parents)
    on = lambda t: t.to(device)  # noqa: E731
    o, u, gamma = _verify(kernels, form)(on(q), on(k), on(v), on(g), on(beta), on(S0), on(M),
                                         use_qk_l2norm_in_kernel=l2, BKC=BKC)
    d = lambda t: t.double()  # noqa: E731
    ro, ru, rg = kda_tree_verify_ref(d(q), d(k), d(v), d(g), d(beta), d(S0), M, use_qk_l2norm_in_kernel=l2)
    tol = 1e-5 if dtype == torch.float32 else 5e-3  # bf16: the output's rounding
    o, u, gamma = o.cpu(), u.cpu(), gamma.cpu()
    assert o.dtype == dtype and _rel(o, ro) <= tol and _rel(u, ru) <= 1e-5 and _rel(gamma, rg) <= 1e-5

    leaf = max(range(T), key=lambda i: (depths(parents)[i], i))
    path = torch.tensor(path_to(parents, leaf) + [-1] * 3)
    S = on(S0.clone())
    kernels.commit.kda_tree_commit_triton(S, on(k), on(u), on(gamma), on(path), use_qk_l2norm_in_kernel=l2)
    assert _rel(S.cpu(), kda_tree_commit_ref(d(S0), d(k), ru, rg, path, l2)) <= 1e-5
    return o, u, gamma


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_triton_verify_and_commit_interpreter(ik, case, form):
    """The Triton verify (each form) and commit against the fp64 references: several row blocks, K not a power of
    two, V not a multiple of the value block, forests, 16-bit inputs; the commit with a right-padded path."""
    _check_verify_and_commit(ik, case, form=form)


def test_neumann_form_at_its_bound_interpreter(ik):
    """The Neumann form at its largest tree, a chain of ``MAX_NODES`` (depth 127: every Horner step used)."""
    _check_verify_and_commit(ik, ("chain", ik.neumann.MAX_NODES, 1, 1, 16, 16, torch.float32, True, 16),
                             form="neumann")


def test_neumann_form_refuses_trees_past_its_bound(ik):
    """The Neumann form holds a tree's coefficient matrix in registers: larger trees are refused, not truncated."""
    T = ik.neumann.MAX_NODES + 1
    q, k, v, g, beta, S0 = kda_inputs(1, T, 1, 1, 16, 16, torch.float32, seed=1)
    M = ancestor_mask(random_parents(T, random.Random(1)))
    with pytest.raises(ValueError, match=f"at most {ik.neumann.MAX_NODES} nodes"):
        ik.neumann.kda_tree_verify_neumann(q, k, v, g, beta, S0, M)


def _channel_spreads(gamma):
    """``[B, HV, tiles, K]``: each pair tile's per-channel spread ``max_{i ∈ I} Γ_ic − min_{j ∈ J} Γ_jc`` (row block I,
    column block J ≤ I, 16 nodes each), in fp32 from the verify's Γ, as the pairs kernel tests it against
    ``PAIR_SPREAD_MAX``: the channel in the dots at most, added on its own past it."""
    blocks = gamma.float().transpose(1, 2).split(16, dim=2)  # [B, HV, ≤16, K] each
    return torch.stack([blocks[i].amax(2) - blocks[c].amin(2) for i in range(len(blocks)) for c in range(i + 1)], 2)


def _assert_paths(spread, limit, path):
    """The channels of ``spread`` take ``path``: "dots" (every channel of every tile within ``limit``), "wide" (every
    one past it) or "mixed" (some tile holds channels of both); where any channel is past it, some spread is past
    fp32's exp range too (e^89 overflows)."""
    wide = spread > limit
    assert {"dots": (~wide).all(), "wide": wide.all(), "mixed": (wide.any(-1) & (~wide).any(-1)).any()}[path], spread
    assert path == "dots" or spread.max() > 89.0, spread.max()


#: pair-tile channels through the dots, each on its own (wide), and both within tiles: (kernel case, gate scale,
#: path); gates scaled up give long paths wide spreads (a deep spine's far tiles), forests and stars spreads within
#: blocks, and ×100 every channel of every tile (no tail block of one node) past the limit.
SPREAD_CASES = [
    (("deep", 37, 1, 1, 32, 24, torch.float32, False, 16), 2.0, "dots"),  # spreads up to 59: near the limit
    (("star", 20, 2, 2, 16, 16, torch.float32, True, 16), 4.0, "dots"),
    (("forest", 24, 1, 2, 40, 16, torch.float32, True, 32), 1.0, "dots"),
    (("random", 18, 1, 2, 32, 16, torch.bfloat16, True, 32), 1.0, "dots"),
    (("chain", 33, 1, 2, 16, 16, torch.float32, True, 16), 2.0, "mixed"),
    (("deep", 50, 1, 2, 32, 16, torch.float32, True, 32), 4.0, "mixed"),
    (("shuffled", 30, 1, 1, 16, 8, torch.float32, False, 16), 4.0, "mixed"),
    (("forest", 24, 1, 2, 40, 16, torch.float32, True, 32), 10.0, "mixed"),  # about half the channels wide
    (("random", 40, 1, 2, 24, 16, torch.float32, False, 16), 10.0, "mixed"),
    (("random", 40, 1, 2, 24, 16, torch.float32, False, 16), 100.0, "wide"),
    (("forest", 48, 1, 2, 16, 16, torch.float32, True, 16), 100.0, "wide"),
]


def _spread_id(c):
    return f"{_case_id(c[0])}-g{c[1]:g}-{c[2]}"


def _check_forced_paths(verify, case, g_scale, got, path, dots_fail):
    """``got`` (a verify's o and u at its default limit) is bit for bit the result with every channel forced into the
    dots (``verify(..., limit=inf)``) exactly where every channel took them (``path`` "dots"), and with every channel
    on its own (``limit=-inf``) exactly where every one did ("wide"); every channel on its own meets the tolerances,
    and with ``dots_fail`` every channel forced into the dots fails them."""
    kind, T, H, HV, K, V, dtype, l2, BKC = case
    parents, x = _case_inputs(case, g_scale)
    M = ancestor_mask(parents)
    ro, ru, _ = kda_tree_verify_ref(*(t.double() for t in x), M, use_qk_l2norm_in_kernel=l2)

    def forced(limit):
        return verify(*x, M, limit=limit, use_qk_l2norm_in_kernel=l2, BKC=BKC)[:2]

    wide = forced(float("-inf"))
    with warnings.catch_warnings():  # past the limit the interpreter's numpy warns of the overflow
        warnings.simplefilter("ignore", RuntimeWarning)
        dots = forced(float("inf"))
    same = lambda a, b: all(torch.equal(p, r) for p, r in zip(a, b))  # noqa: E731
    assert same(got, wide) == (path == "wide") and same(got, dots) == (path == "dots")
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert _rel(wide[0], ro) <= tol and _rel(wide[1], ru) <= 1e-5
    assert not dots_fail or max(_rel(dots[0], ro), _rel(dots[1], ru)) > 1e-3


@pytest.mark.parametrize("case,g_scale,path", SPREAD_CASES, ids=[_spread_id(c) for c in SPREAD_CASES])
def test_triton_pair_scores_dots_and_wide_channels_interpreter(ik, case, g_scale, path):
    """The pair scores as dots (the decay folded into the operands) over the channels whose Γ spread in a tile allows,
    each wider channel added exactly on its own, all of one kind or mixed in tiles: the verify and commit against the
    fp64 references; the channels take the expected path (the verify bit for bit as with every channel forced through
    that path: ``pair_spread_max`` ±inf); every channel on its own meets the tolerances too, and every channel forced
    into the dots fails them where some spread is past fp32's range (the wide path is what keeps those right)."""
    kind, T, H, HV, K, V, dtype, l2, BKC = case
    o, u, gamma = _check_verify_and_commit(ik, case, g_scale=g_scale)
    _assert_paths(_channel_spreads(gamma), ik.fused.PAIR_SPREAD_MAX, path)

    _check_forced_paths(lambda *a, limit, **kw: ik.fused.kda_tree_verify_triton(*a, pair_spread_max=limit, **kw),
                        case, g_scale, (o, u), path, dots_fail=path != "dots")


def _block_spreads(gamma):
    """``[B, HV, blocks, K]``: each row block's per-channel Γ spread (16 nodes; the last may hold fewer), as the strip
    form tests it against its ``SPREAD_MAX``."""
    return torch.stack([b.amax(2) - b.amin(2) for b in gamma.float().transpose(1, 2).split(16, dim=2)], 2)


#: the strip form's row-block channels through the dots, each on its own, and both: (kernel case, gate scale, path)
STRIP_SPREAD_CASES = [
    (("deep", 37, 1, 1, 32, 24, torch.float32, False, 16), 4.0, "dots"),  # spreads up to 117: near the limit
    (("random", 18, 1, 2, 32, 16, torch.bfloat16, True, 32), 1.0, "dots"),
    (("forest", 24, 1, 2, 40, 16, torch.float32, True, 32), 10.0, "mixed"),  # 4 % of the block channels wide
    (("chain", 33, 1, 2, 16, 16, torch.float32, True, 16), 6.0, "mixed"),  # 26 %
    (("shuffled", 30, 1, 1, 16, 8, torch.float32, False, 16), 10.0, "mixed"),
    (("random", 40, 1, 2, 24, 16, torch.float32, False, 16), 20.0, "mixed"),  # 55 %
    (("forest", 48, 1, 2, 16, 16, torch.float32, True, 16), 100.0, "wide"),
    (("deep", 16, 1, 2, 16, 16, torch.float32, True, 16), 10.0, "mixed"),  # one row block
    (("deep", 16, 1, 2, 16, 16, torch.float32, True, 16), 100.0, "wide"),
]


@pytest.mark.parametrize("case,g_scale,path", STRIP_SPREAD_CASES, ids=[_spread_id(c) for c in STRIP_SPREAD_CASES])
def test_strip_pair_scores_dots_and_wide_channels_interpreter(ik, case, g_scale, path):
    """The strip form's pair scores: a row block's channel within ``SPREAD_MAX`` through the dots against the block's
    midpoint, a wider one exactly on its own; the verify and commit against the fp64 references, the channels on the
    expected path (bit for bit the result with every channel forced one way, ``spread_max`` ±inf), every channel on
    its own within the tolerances too, and every channel forced into the dots failing them where a spread leaves
    fp32's exp range on both sides of the midpoint (e^±89)."""
    kind, T, H, HV, K, V, dtype, l2, BKC = case
    o, u, gamma = _check_verify_and_commit(ik, case, g_scale=g_scale, form="strip")
    spread = _block_spreads(gamma)
    _assert_paths(spread, ik.strip.SPREAD_MAX, path)

    _check_forced_paths(lambda *a, limit, **kw: ik.strip.kda_tree_verify_strip(*a, spread_max=limit, **kw),
                        case, g_scale, (o, u), path, dots_fail=bool(spread.max() > 2 * 89.0))


@pytest.mark.parametrize("case,g_scale", [(("chain", 33, 1, 2, 16, 16, torch.float32, True, 16), 6.0),
                                          (("forest", 48, 1, 2, 16, 16, torch.float32, True, 16), 100.0)],
                         ids=["chain-T33-g6", "forest-T48-g100"])
def test_strip_rows_take_gamma_from_every_nodes_sums_interpreter(ik, monkeypatch, case, g_scale):
    """The strip form's pair factors ``e^{Γ_i − Γ_j}`` take both Γs from one sum per node. Tensor cores may round
    two dots of the same sums apart (a row block's and the whole tree's), and the factor amplifies that by |Γ|: on an
    H100 the steep-gate cases' o was off by 1.1–2.7e-5 when the rows' Γ came from a dot of their own. Emulated here:
    the interpreter's 0/1 mask dots that sum several entries a row round one ulp up for row blocks and one down for
    the whole tree (such a skew puts o at 3.6e-5 and 1.4e-4 here when the rows sum their own gates)."""
    import numpy as np
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def skewed(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        m = a.data
        if m.ndim == 2 and np.isin(m, (0.0, 1.0)).all() and (m.sum(1) > 1).any():
            f = np.float32(1 + 2**-23 if m.shape[0] != m.shape[1] else 1 - 2**-23)
            out = interpreter.TensorHandle((out.data * f).astype(np.float32), out.dtype)
        return out

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", skewed)
    _check_verify_and_commit(ik, case, g_scale=g_scale, form="strip")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case,g_scale,path", SPREAD_CASES + [
    (("deep", 64, 32, 32, 128, 128, torch.float32, True, 32), 4.0, "mixed"),  # Kimi Linear's shape
], ids=lambda x: _case_id(x) if isinstance(x, tuple) else str(x))
def test_triton_pair_scores_dots_and_wide_channels_on_gpu(case, g_scale, path):
    """The compiled kernels on the channels through dots, each on its own, and both within tiles."""
    from weaver_kernels.kda_tree import commit, fused

    _, _, gamma = _check_verify_and_commit(SimpleNamespace(fused=fused, commit=commit), case, "cuda", g_scale)
    _assert_paths(_channel_spreads(gamma.cpu()), fused.PAIR_SPREAD_MAX, path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case,g_scale,path", STRIP_SPREAD_CASES + [
    (("deep", 16, 32, 32, 128, 128, torch.float32, True, 32), 6.0, "mixed"),  # Kimi Linear's shape, one row block
    (("deep", 64, 32, 32, 128, 128, torch.float32, True, 32), 4.0, "mixed"),
], ids=lambda x: _case_id(x) if isinstance(x, tuple) else str(x))
def test_strip_pair_scores_dots_and_wide_channels_on_gpu(case, g_scale, path):
    """The compiled strip form on row-block channels through the dots, each on its own, and both."""
    from weaver_kernels.kda_tree import commit, strip

    _, _, gamma = _check_verify_and_commit(SimpleNamespace(strip=strip, commit=commit), case, "cuda", g_scale,
                                           form="strip")
    _assert_paths(_block_spreads(gamma.cpu()), strip.SPREAD_MAX, path)


#: Kimi Linear's KDA shape (32 heads of 128) with a 64-node tree, in both dtypes the model runs in, and a 16-node one.
REAL_SHAPE_CASES = [("random", 64, 32, 32, 128, 128, torch.bfloat16, True, 32),
                    ("random", 16, 32, 32, 128, 128, torch.bfloat16, True, 32),
                    ("deep", 64, 32, 32, 128, 128, torch.float32, True, 32)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", KERNEL_CASES + REAL_SHAPE_CASES, ids=_case_id)
def test_triton_verify_and_commit_on_gpu(case, form):
    """The compiled kernels (not the interpreter), each form, on the small cases and at Kimi Linear's shape."""
    from weaver_kernels.kda_tree import commit, fused, neumann, strip

    _check_verify_and_commit(SimpleNamespace(fused=fused, neumann=neumann, strip=strip, commit=commit), case, "cuda",
                             form=form)


def _raw_gate_case(kind, T, H, K, V, dtype, seed):
    """A tree and KimiLinear's layer inputs as the adapter hands them to the ops: q, k, v, the raw projections f and b,
    ``A_log [1, 1, H, 1]`` and ``dt_bias [H·K]`` as the module holds them, the fp32 committed state, and a deepest
    leaf's path right-padded with -1."""
    parents = _tree(kind, T, random.Random(seed))
    q, k, v, _, _, S0 = kda_inputs(1, T, H, H, K, V, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    f = (torch.randn(1, T, H, K, generator=gen) * 3).to(dtype)
    b = torch.randn(1, T, H, generator=gen).to(dtype)
    A_log = (torch.randn(1, 1, H, 1, generator=gen) * 0.5).to(dtype)
    dt_bias = torch.randn(H * K, generator=gen).to(dtype)
    leaf = max(range(T), key=lambda i: (depths(parents)[i], i))
    path = torch.tensor(path_to(parents, leaf) + [-1] * 3)
    return SimpleNamespace(q=q, k=k, v=v, f=f, b=b, A_log=A_log, dt_bias=dt_bias, S0=S0.float(),
                           M=ancestor_mask(parents), path=path)


def _raw_gate_refs(c):
    """The fp64 references of a :func:`_raw_gate_case`: the gates formed as transformers forms them (β in b's dtype),
    then verify and the commit of ``c.path``."""
    g, beta = kda_gates(c.f, c.b, c.A_log, c.dt_bias)
    d = lambda t: t.double()  # noqa: E731
    o, u, gamma = kda_tree_verify_ref(d(c.q), d(c.k), d(c.v), d(g), d(beta), d(c.S0), c.M,
                                      use_qk_l2norm_in_kernel=True)
    return o, u, gamma, kda_tree_commit_ref(d(c.S0), d(c.k), u, gamma, c.path, True)


def _assert_near_refs(o, u, gamma, S, refs, dtype):
    """The tolerances of :func:`_check_verify_and_commit`."""
    ro, ru, rg, rS = refs
    tol = 1e-5 if dtype == torch.float32 else 5e-3  # bf16: the output's rounding
    assert o.dtype == dtype and _rel(o.cpu(), ro) <= tol
    assert _rel(u.cpu(), ru) <= 1e-5 and _rel(gamma.cpu(), rg) <= 1e-5 and _rel(S.cpu(), rS) <= 1e-5


def test_ops_take_the_triton_kernels_for_cuda_tensors(ik, monkeypatch):
    """``kda_tree_verify`` / ``kda_tree_commit`` send CUDA tensors to the Triton verify and commit with the adapter's
    raw gates as they are, and CPU tensors to the references. On the CPU: inputs that say they are on CUDA, the
    interpreted kernels standing in for the compiled ones (tiny Kimi Linear's heads of 8: key and value blocks
    masked), against the fp64 references."""
    import weaver_kernels as wk
    from weaver_kernels.kda_tree import commit, fused, strip

    class OnCuda(torch.Tensor):  # what the op bodies' dispatch reads; the kernels get plain CPU tensors
        @property
        def is_cuda(self):
            return True

    calls = []

    def stand_in(name, kernel):
        plain = lambda x: x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else x  # noqa: E731

        def run(*args, **kwargs):
            calls.append((name, sorted(kwargs)))
            return kernel(*map(plain, args), **{key: plain(x) for key, x in kwargs.items()})
        return run

    monkeypatch.setattr(fused, "kda_tree_verify_triton", stand_in("fused", ik.fused.kda_tree_verify_triton))
    monkeypatch.setattr(strip, "kda_tree_verify_strip", stand_in("strip", ik.strip.kda_tree_verify_strip))
    monkeypatch.setattr(commit, "kda_tree_commit_triton", stand_in("commit", ik.commit.kda_tree_commit_triton))
    for T, form in ((21, "strip"), (strip.MAX_NODES, "strip"), (strip.MAX_NODES + 1, "fused")):
        calls.clear()
        c = _raw_gate_case("random", T, 4, 8, 8, torch.float32, seed=6)
        refs = _raw_gate_refs(c)
        o, u, gamma = wk.kda_tree_verify(c.q.as_subclass(OnCuda), c.k, c.v, c.f, c.b, c.S0, c.M,
                                         use_qk_l2norm_in_kernel=True, A_log=c.A_log, dt_bias=c.dt_bias)
        S = c.S0.clone()
        wk.kda_tree_commit(S.as_subclass(OnCuda), c.k, u, gamma, c.path, use_qk_l2norm_in_kernel=True)
        assert calls == [(form, ["A_log", "dt_bias"]), ("commit", [])], T
        _assert_near_refs(o, u, gamma, S, refs, torch.float32)

    o, u, gamma = wk.kda_tree_verify(c.q, c.k, c.v, c.f, c.b, c.S0, c.M, use_qk_l2norm_in_kernel=True,
                                     A_log=c.A_log, dt_bias=c.dt_bias)
    S = wk.kda_tree_commit(c.S0.clone(), c.k, u, gamma, c.path, use_qk_l2norm_in_kernel=True)
    assert len(calls) == 2  # CPU tensors: the references
    _assert_near_refs(o, u, gamma, S, refs, torch.float32)
    assert wk.max_tree_nodes("cuda") == fused.MAX_NODES and wk.max_tree_nodes("cpu") is None


#: tiny Kimi Linear's heads (4 of 8) on both sides of the strip form's node limit, then Kimi Linear's KDA shape (32
#: heads of 128) with a 64-node tree.
OP_GPU_CASES = [("random", 33, 4, 8, 8, torch.float32), ("random", 65, 4, 8, 8, torch.float32),
                ("random", 64, 32, 128, 128, torch.bfloat16), ("deep", 64, 32, 128, 128, torch.float32)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", OP_GPU_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}V{c[4]}-{str(c[5])[6:]}")
def test_ops_run_triton_on_gpu(case):
    """The ops on CUDA with the adapter's raw gates: the results (bit for bit) of the Triton form they dispatch to by
    node count (strips up to ``strip.MAX_NODES``, else fused), within the fp64 references' tolerances; no host sync
    (sync debug mode, then verify + commit + decode captured in a CUDA graph and replayed from a fresh state); fake
    implementations against the kernels (``opcheck``, small cases)."""
    import weaver_kernels as wk
    from weaver_kernels.kda_tree import commit, fused, strip

    kind, T, H, K, V, dtype = case
    c = _raw_gate_case(kind, T, H, K, V, dtype, seed=T)
    refs = _raw_gate_refs(c)
    x = SimpleNamespace(**{name: t.cuda() for name, t in vars(c).items()})
    raw = dict(A_log=x.A_log, dt_bias=x.dt_bias)
    args = (x.q, x.k, x.v, x.f, x.b, x.S0, x.M)
    form = strip.kda_tree_verify_strip if T <= strip.MAX_NODES else fused.kda_tree_verify_triton
    want = form(*args, use_qk_l2norm_in_kernel=True, **raw)  # (compiles the kernels first)
    S_want = commit.kda_tree_commit_triton(x.S0.clone(), x.k, want[1], want[2], x.path, True)
    one = [t[:, :1] for t in (x.q, x.k, x.v, x.f, x.b)]  # the AR step's token (kda_decode: the reference on CUDA)
    S, S_dec = x.S0.clone(), x.S0.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, u, gamma = wk.kda_tree_verify(*args, use_qk_l2norm_in_kernel=True, **raw)
        wk.kda_tree_commit(S, x.k, u, gamma, x.path, use_qk_l2norm_in_kernel=True)
        o_dec = wk.kda_decode(*one, S_dec, use_qk_l2norm_in_kernel=True, **raw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip((o, u, gamma), want)) and torch.equal(S, S_want)
    _assert_near_refs(o, u, gamma, S, refs, dtype)

    S_static, S_dec_static = x.S0.clone(), x.S0.clone()

    def step():
        o, u, gamma = wk.kda_tree_verify(*args, use_qk_l2norm_in_kernel=True, **raw)
        wk.kda_tree_commit(S_static, x.k, u, gamma, x.path, use_qk_l2norm_in_kernel=True)
        return o, wk.kda_decode(*one, S_dec_static, use_qk_l2norm_in_kernel=True, **raw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, o_dec_static = step()
    for _ in range(2):
        S_static.copy_(x.S0)
        S_dec_static.copy_(x.S0)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_static, o) and torch.equal(S_static, S)
    assert torch.equal(o_dec_static, o_dec) and torch.equal(S_dec_static, S_dec)

    if K <= 8:
        torch.library.opcheck(torch.ops.weaver.kda_tree_verify.default,
                              (*args, K**-0.5, True, x.A_log, x.dt_bias))
        torch.library.opcheck(torch.ops.weaver.kda_tree_commit.default, (x.S0.clone(), x.k, u, gamma, x.path, True))


@pytest.mark.parametrize("form", FORMS)
def test_triton_forgetting_channels_interpreter(ik, form):
    """Off-path Γ differences past the exp's range (a channel with g = −1000) stay masked in the kernels too."""
    parents = random_parents(20, random.Random(5))
    q, k, v, g, beta, S0 = kda_inputs(1, 20, 1, 1, 16, 16, torch.float32, seed=11)
    g[:, 3::4, :, 0] = -1000.0
    M = ancestor_mask(parents)
    o, u, gamma = _verify(ik, form)(q, k, v, g, beta, S0, M, use_qk_l2norm_in_kernel=True)
    ro, ru, rg = kda_tree_verify_ref(q.double(), k.double(), v.double(), g.double(), beta.double(), S0.double(), M,
                                     use_qk_l2norm_in_kernel=True)
    assert _rel(o, ro) <= 1e-5 and _rel(u, ru) <= 1e-5
    path = torch.tensor(path_to(parents, 19))
    S = ik.commit.kda_tree_commit_triton(S0.clone(), k, u, gamma, path, use_qk_l2norm_in_kernel=True)
    assert _rel(S, kda_tree_commit_ref(S0.double(), k.double(), ru, rg, path, True)) <= 1e-5


def test_triton_raw_gates_interpreter(ik):
    """With A_log and dt_bias the kernel forms KimiLinear's gates from the raw projections (both sides of the
    softplus's 20) and matches the reference fed the same raw inputs; fp32 (the interpreter truncates where the GPU
    rounds β to 16 bits)."""
    T, H, K, V = 21, 2, 16, 16
    parents = random_parents(T, random.Random(4))
    q, k, v, _, _, S0 = kda_inputs(1, T, H, H, K, V, torch.float32, seed=9)
    gen = torch.Generator().manual_seed(3)
    f = torch.randn(1, T, H, K, generator=gen) * 12
    f[..., 0, 0] = 25.0  # past the softplus's linear switch, with a slow decay there
    b = torch.randn(1, T, H, generator=gen) * 3
    A_log, dt_bias = torch.randn(1, 1, H, 1, generator=gen) - 3.0, torch.randn(H * K, generator=gen)
    M = ancestor_mask(parents)
    o, u, gamma = ik.fused.kda_tree_verify_triton(q, k, v, f, b, S0, M, use_qk_l2norm_in_kernel=True, A_log=A_log,
                                                  dt_bias=dt_bias)
    d = lambda t: t.double()  # noqa: E731
    g, beta = kda_gates(d(f), d(b), d(A_log), d(dt_bias))
    ro, ru, rg = kda_tree_verify_ref(d(q), d(k), d(v), g, d(beta), d(S0), M, use_qk_l2norm_in_kernel=True)
    assert _rel(o, ro) <= 1e-5 and _rel(u, ru) <= 1e-5 and _rel(gamma, rg) <= 1e-5
    with pytest.raises(ValueError, match="one per channel"):
        ik.fused.kda_tree_verify_triton(q, k, v, f, b, S0, M, A_log=A_log, dt_bias=dt_bias[:H])


@pytest.mark.parametrize("form", FORMS)
def test_triton_fast_decays_interpreter(ik, form):
    """Gates far past the model's usual range (``A_log`` raised by 4–5: a mean |g| of 57–265 nats a token, so each
    step all but wipes the state): there fp32 itself loses digits (Γ sums hundreds of nats, its rounding enters every
    exponent), so each form is held to the fp32 torch reference's own error against fp64 (within 8×: Γ summed in
    another order), or 1e-5 where that is larger."""
    for kind, T, shift in (("deep", 37, 5.0), ("random", 40, 5.0), ("chain", 33, 4.0)):
        c = _raw_gate_case(kind, T, 1, 16, 16, torch.float32, seed=T)
        c.A_log = c.A_log + shift
        ro, ru, rg, rS = _raw_gate_refs(c)
        g, beta = kda_gates(c.f, c.b, c.A_log, c.dt_bias)
        fo, fu, fg = kda_tree_verify_ref(c.q, c.k, c.v, g, beta.float(), c.S0, c.M, use_qk_l2norm_in_kernel=True)
        fS = kda_tree_commit_ref(c.S0.clone(), c.k, fu, fg, c.path, True)
        o, u, gamma = _verify(ik, form)(c.q, c.k, c.v, c.f, c.b, c.S0, c.M, use_qk_l2norm_in_kernel=True,
                                        A_log=c.A_log, dt_bias=c.dt_bias)
        S = ik.commit.kda_tree_commit_triton(c.S0.clone(), c.k, u, gamma, c.path, use_qk_l2norm_in_kernel=True)
        for name, got, ref, fp32 in (("o", o, ro, fo), ("u", u, ru, fu), ("gamma", gamma, rg, fg), ("S", S, rS, fS)):
            assert _rel(got, ref) <= max(1e-5, 8 * _rel(fp32, ref)), (kind, name, _rel(got, ref), _rel(fp32, ref))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind,T,A_shift,path", [("forest", 33, 1.0, "dots"), ("deep", 37, 1.0, "mixed"),
                                                 ("random", 21, 2.0, "mixed"), ("random", 21, 5.0, "wide")])
def test_triton_raw_gates_dots_and_wide_channels_interpreter(ik, kind, T, A_shift, path, form):
    """Gates formed in the kernel (the adapter's raw projections, ``A_log`` raised so decays are faster) with pair
    tile channels through the dots, each on its own, and both: verify (each form) and commit against the fp64
    references."""
    c = _raw_gate_case(kind, T, 2, 16, 16, torch.float32, seed=T)
    c.A_log = c.A_log + A_shift
    refs = _raw_gate_refs(c)
    o, u, gamma = _verify(ik, form)(c.q, c.k, c.v, c.f, c.b, c.S0, c.M, use_qk_l2norm_in_kernel=True,
                                    A_log=c.A_log, dt_bias=c.dt_bias)
    S = ik.commit.kda_tree_commit_triton(c.S0.clone(), c.k, u, gamma, c.path, use_qk_l2norm_in_kernel=True)
    _assert_near_refs(o, u, gamma, S, refs, torch.float32)
    _assert_paths(_channel_spreads(gamma), ik.fused.PAIR_SPREAD_MAX, path)
