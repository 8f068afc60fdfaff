"""Native CPU kernels of the Weaver tree build (``cpu.c``), beside their torch references (:mod:`.naive`).

On a CPU, a Weaver build's arithmetic is small and its cost is the few hundred torch calls between its GEMMs. Each
function here does one stage between two GEMMs in one C call: the node attention (RoPE, slot writes, attention), the
pool scores, a round's frontier bookkeeping, the root's extra leaves, the final pick of the tree, and the norms and
activation around the GEMMs. Same arithmetic as the references (fp32, results rounded to the tensors' dtypes, stable
orders), summed in other orders: equal to them within rounding.

The C file is compiled on first use with the system's C compiler (``$CC``, else ``cc``) into the user's cache
(``$XDG_CACHE_HOME/weaver_kernels``, else ``~/.cache/weaver_kernels``), one library per source, compiler and CPU. Where
no compiler is found, :func:`available` is False and the ops run their torch references (a warning says so once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import types
import warnings
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = Path(__file__).with_name("cpu.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_DTYPES = types.MappingProxyType({torch.float32: 0, torch.bfloat16: 1})  # (the kernels' dtype codes)
_TAKEN = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
_P, _I, _F, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = types.MappingProxyType({
    "weaver_rms_norm": (_D, [_P, _P, _P, _P, _D, _P, _P, _D, _I, _I, _F]),
    "weaver_silu_mul": (_D, [_P, _P, _D, _I, _I]),
    "weaver_prompt_norm": (_D, [_P, _D, _P, _D, _I, _I, _P, _P, _D, _F, _P, _D]),
    "weaver_node_attention": (_D, [_P, _D, _P, _P, _P, _D, _I, _P, _P, _D, _I, _P, _I, _I, _I, _I, _F, _F, _P, _P, _I,
                                    _P]),
    "weaver_pool_scores": (_D, [_P, _D, _I, _I, _P, _P, _I, _P, _I, _P, _D, _I, _P]),
    "weaver_expand": (_D, [_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I]),
    "weaver_root_leaves": (_I, [_P, _P, _I, _I, _I, _P, _P]),
    "weaver_spine_tree": (_D, [_P, _D, _I, _P, _P, _P, _P, _I, _P, _D, _I, _I, _I, _I, _I, _P, _P, _P]),
    "weaver_spine_init": (None, [_P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I]),
    "weaver_pool_topk": (_D, [_P, _D, _I, _I, _I, _I, _P, _P]),
    "weaver_best_known": (_D, [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _I, _I, _P, _P, _P]),
})


def _cpu_key() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags (a cache shared between machines must not
    hand one CPU's library to another)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "weaver_kernels"


@functools.lru_cache(maxsize=None)
def _library():
    """The compiled library, or None (with a warning) where it cannot be built or loaded."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        warnings.warn("weaver_kernels: no C compiler (cc or $CC) found, so the CPU Weaver tree build runs its torch "
                      "references (same trees within rounding, several times slower)", RuntimeWarning, stacklevel=3)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256("\0".join([_SOURCE.read_text(), compiler, version, *_FLAGS, _cpu_key()]).encode())
        target = _cache_dir() / f"weaver_cpu_{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # (built aside, then renamed: atomic)
                built = Path(tmp) / target.name
                subprocess.run([compiler, *_FLAGS, "-o", str(built), str(_SOURCE), "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or err
        warnings.warn(f"weaver_kernels: the native CPU kernels could not be built ({str(detail).strip()[:500]}), so "
                      "the CPU Weaver tree build runs its torch references", RuntimeWarning, stacklevel=3)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def available() -> bool:
    """Whether the native kernels are built and loaded (compiled on the first call). False inside a
    ``torch.compile`` trace: a traced step takes the torch references (an opaque C call cannot be traced)."""
    return not torch.compiler.is_compiling() and _library() is not None


def supports(*tensors: Tensor) -> bool:
    """Whether the native kernels take these tensors: on the CPU, contiguous, in fp32, bf16, int64 or bool."""
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype in _TAKEN for t in tensors) and available()


def _need(name: str, floats: tuple[Tensor, ...], longs: tuple[Tensor, ...] = (), bools: tuple[Tensor, ...] = ()
          ) -> None:
    """The kernels read raw memory: anything else than contiguous CPU tensors of the dtypes they take is refused."""
    for group, dtypes, what in ((floats, (torch.float32, torch.bfloat16), "fp32 or bf16"),
                                (longs, (torch.int64,), "int64"), (bools, (torch.bool,), "bool")):
        for t in group:
            if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in dtypes:
                raise ValueError(f"weaver_kernels.weaver_tree.cpu.{name} takes contiguous CPU tensors ({what} here), "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}"
                                 f"{'' if t.is_contiguous() else ', not contiguous'}")


def _check(status: int, name: str) -> None:
    if status == -2:
        raise IndexError(f"weaver_kernels.weaver_tree.cpu.{name}: a pool id is not a row of the weight, or a node's "
                         "pool row is not a row of the pool")
    if status != 0:
        raise MemoryError(f"weaver_kernels: {name} could not allocate its scratch memory")


def rms_norm_bias(x: Tensor, weight: Tensor, bias: Tensor, eps: float, add: Tensor | None = None
                  ) -> Tensor | tuple[Tensor, Tensor]:
    """``WeaverRMSNorm`` of the rows of ``x [..., d]`` (``weight``, ``bias``: ``[d]``, both in fp32 or bf16). With
    ``add``, of ``x + add`` (the residual add, rounded to x's dtype), returned too: ``(x + add, norm(x + add))``."""
    _need("rms_norm_bias", (x, weight, bias) if add is None else (x, weight, bias, add))
    d = x.shape[-1]
    if weight.shape != (d,) or bias.shape != (d,) or (add is not None and add.shape != x.shape):
        raise ValueError(f"rms_norm_bias: weight and bias [{d}] and add shaped as x {tuple(x.shape)}; got "
                         f"{tuple(weight.shape)}, {tuple(bias.shape)}, {None if add is None else tuple(add.shape)}")
    out = torch.empty_like(x)
    x_out = None if add is None else torch.empty_like(x)
    _check(_library().weaver_rms_norm(x.data_ptr(), None if add is None else add.data_ptr(),
                                      None if add is None else x_out.data_ptr(), out.data_ptr(), _DTYPES[x.dtype],
                                      weight.data_ptr(), bias.data_ptr(), _DTYPES[weight.dtype], x.numel() // d, d,
                                      eps), "rms_norm_bias")
    return out if add is None else (x_out, out)


def prompt_norm(first: Tensor, rest: Tensor, weight: Tensor, bias: Tensor, eps: float, dtype: torch.dtype
                ) -> Tensor:
    """``WeaverRMSNorm`` of the rows ``[first; rest]`` (``first [d]``, ``rest [count, d]``, each fp32 or bf16) cast to
    ``dtype`` first, as ``WeaverModel.encode_prompt`` casts its features: ``[1 + count, d]`` in ``dtype``."""
    _need("prompt_norm", (first, rest, weight, bias))
    d = first.shape[-1]
    if first.shape != (d,) or rest.dim() != 2 or rest.shape[1] != d or weight.shape != (d,) or bias.shape != (d,):
        raise ValueError(f"prompt_norm: first [d], rest [count, d], weight and bias [d]; got {tuple(first.shape)}, "
                         f"{tuple(rest.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    out = torch.empty(1 + rest.shape[0], d, dtype=dtype)
    _check(_library().weaver_prompt_norm(first.data_ptr(), _DTYPES[first.dtype], rest.data_ptr(), _DTYPES[rest.dtype],
                                         rest.shape[0], d, weight.data_ptr(), bias.data_ptr(), _DTYPES[weight.dtype],
                                         eps, out.data_ptr(), _DTYPES[dtype]), "prompt_norm")
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` of rows ``[gate | up]`` (``gate_up [..., 2·w]`` → ``[..., w]``), each op rounded as
    torch's."""
    _need("silu_mul", (gate_up,))
    w = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], w))
    _check(_library().weaver_silu_mul(gate_up.data_ptr(), out.data_ptr(), _DTYPES[gate_up.dtype],
                                      gate_up.numel() // (2 * w), w), "silu_mul")
    return out


@functools.lru_cache(maxsize=16)
def _rope_table(base: float, dim: int, rows: int = 64) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin ``[rows, dim / 2]`` of positions ``0..rows-1``, computed as ``rope_halves`` computes them
    (the same torch ops: the same values), so the kernel needs no trigonometry for the positions a tree reaches."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(rows).float()[:, None] * inv_freq
    return angles.cos().contiguous(), angles.sin().contiguous()


def node_attention(qkv: Tensor, positions: Tensor, prompt_k: Tensor, prompt_v: Tensor, node_k: Tensor,
                   node_v: Tensor, mask: Tensor, lo: int, rope_base: float, scale: float, want_output: bool = True
                   ) -> Tensor | None:
    """:func:`~weaver_kernels.weaver_tree.naive.node_attention_ref` (same arguments); ``want_output=False`` only
    writes the slots (a prompt's last layer, whose outputs nobody reads)."""
    _need("node_attention", (qkv, prompt_k, prompt_v, node_k, node_v), (positions,), (mask,))
    M = qkv.shape[0]
    H, n, D = node_k.shape
    if (qkv.shape != (M, 3 * H * D) or positions.shape != (M,) or node_v.shape != node_k.shape
            or prompt_k.dim() != 3 or prompt_k.shape[::2] != (H, D) or prompt_v.shape != prompt_k.shape
            or mask.shape != (M, n) or not 0 <= lo <= n - M):
        raise ValueError(f"node_attention: qkv [M, 3·H·D], positions [M], prompt K/V [H, P, D], node K/V [H, n, D], "
                         f"mask [M, n] and slots lo..lo+M-1 inside n; got {tuple(qkv.shape)}, "
                         f"{tuple(positions.shape)}, {tuple(prompt_k.shape)}, {tuple(node_k.shape)}, "
                         f"{tuple(mask.shape)}, lo {lo}")
    out = qkv.new_empty((M, H * D)) if want_output else None
    cos, sin = _rope_table(rope_base, D)
    _check(_library().weaver_node_attention(
        qkv.data_ptr(), _DTYPES[qkv.dtype], positions.data_ptr(), prompt_k.data_ptr(), prompt_v.data_ptr(),
        _DTYPES[prompt_k.dtype], prompt_k.shape[1], node_k.data_ptr(), node_v.data_ptr(), _DTYPES[node_k.dtype], n,
        mask.data_ptr(), M, H, D, lo, rope_base, scale, cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        None if out is None else out.data_ptr()), "node_attention")
    return out


def pool_scores(query: Tensor, rows: Tensor, pool_ids: Tensor, pool_logits: Tensor, weight: Tensor) -> Tensor:
    """:func:`~weaver_kernels.weaver_tree.naive.pool_scores_ref` (same arguments)."""
    _need("pool_scores", (query, pool_logits, weight), (rows, pool_ids))
    M, d = query.shape
    C = pool_ids.shape[1]
    if (rows.shape != (M,) or pool_logits.shape != pool_ids.shape or pool_logits.dtype != torch.float32
            or weight.dim() != 2 or weight.shape[1] != d):
        raise ValueError(f"pool_scores: query [M, d], rows [M] of pool rows, pool ids and fp32 logits [D, P], weight "
                         f"[V, d]; got {tuple(query.shape)}, {tuple(rows.shape)}, {tuple(pool_ids.shape)}, "
                         f"{pool_logits.dtype} {tuple(pool_logits.shape)}, {tuple(weight.shape)}")
    out = torch.empty(M, C, dtype=torch.float32)
    _check(_library().weaver_pool_scores(query.data_ptr(), _DTYPES[query.dtype], M, d, rows.data_ptr(),
                                         pool_ids.data_ptr(), pool_ids.shape[0], pool_logits.data_ptr(), C,
                                         weight.data_ptr(), _DTYPES[weight.dtype], weight.shape[0], out.data_ptr()),
           "pool_scores")
    return out


def weaver_expand(cand: Tensor, pool_ids: Tensor, tokens: Tensor, parents: Tensor, logq: Tensor, depth: Tensor,
                  score: Tensor, mask: Tensor, f_score: Tensor, f_token: Tensor, f_logq: Tensor, lo: int, hi: int,
                  take: int, max_depth: int, spine: int = 0) -> None:
    """:func:`~weaver_kernels.weaver_tree.naive.weaver_expand_ref` (same arguments, in place)."""
    _need("weaver_expand", (cand, logq, score, f_score, f_logq), (pool_ids, tokens, parents, depth, f_token), (mask,))
    n = tokens.shape[0]
    _check(_library().weaver_expand(
        cand.data_ptr(), cand.shape[1], pool_ids.data_ptr(), tokens.data_ptr(), parents.data_ptr(), logq.data_ptr(),
        depth.data_ptr(), score.data_ptr(), mask.data_ptr(), f_score.data_ptr(), f_token.data_ptr(),
        f_logq.data_ptr(), n, f_score.shape[0] // n, lo, hi, take, max_depth, spine), "weaver_expand")


def spine_buffers(root: int | Tensor, pool_ids: Tensor, spine: int, n: int, fan: int) -> tuple[Tensor, ...]:
    """The buffers of a spine build (``tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq``, as
    ``weaver_tree_tensors`` sets them up) in one call: the root, nodes ``1..spine`` the chain of ``pool_ids [D, P]``'s
    first candidates, the rest padding roots, an empty frontier of ``n · fan`` entries."""
    root = torch.as_tensor(root, dtype=torch.long).view(1)  # (read by the kernel: no host read of a tensor root)
    _need("spine_buffers", (), (pool_ids, root))
    longs, floats = (torch.empty(n, dtype=torch.long) for _ in range(3)), (torch.empty(n) for _ in range(2))
    (tokens, parents, depth), (logq, score) = longs, floats
    mask = torch.empty(n, n, dtype=torch.bool)
    f_score, f_token, f_logq = torch.empty(n * fan), torch.empty(n * fan, dtype=torch.long), torch.empty(n * fan)
    _library().weaver_spine_init(root.data_ptr(), pool_ids.data_ptr(), pool_ids.shape[1], spine, tokens.data_ptr(),
                                 parents.data_ptr(), logq.data_ptr(), depth.data_ptr(), score.data_ptr(),
                                 mask.data_ptr(), f_score.data_ptr(), f_token.data_ptr(), f_logq.data_ptr(), n, fan)
    return tokens, parents, logq, depth, score, mask, f_score, f_token, f_logq


def pool_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``logits [D, V]``'s top ``k`` of each row as ``(fp32 values [D, k], ids [D, k])``, in a stable descending order
    (NaN first, the lowest index first among equal values): ``torch.topk`` (as ``sorted=True``) but for the order of
    ties, with the values widened to fp32. Rows may be strided (a slice of a wider tensor)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"pool_topk: logits [D, V] with unit column stride and 1 <= k <= V; got "
                         f"{tuple(logits.shape)} strides {logits.stride()}, k {k}")
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pool_topk takes fp32 or bf16 CPU logits, got {logits.dtype} on {logits.device}")
    rows, V = logits.shape
    values, ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.long)
    _check(_library().weaver_pool_topk(logits.data_ptr(), _DTYPES[logits.dtype], rows, V, logits.stride(0), k,
                                       values.data_ptr(), ids.data_ptr()), "pool_topk")
    return values, ids


def root_leaves(cand: Tensor, ids: Tensor, fan: int, children: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """``tree._root_leaves`` (same arguments and result)."""
    _need("root_leaves", (cand,), (ids,))
    end = min(children, cand.shape[0] - 1)
    if end <= fan:
        return None
    values, tokens = torch.empty(end - fan), torch.empty(end - fan, dtype=torch.long)
    count = _library().weaver_root_leaves(cand.data_ptr(), ids.data_ptr(), cand.shape[0], fan, end,
                                          values.data_ptr(), tokens.data_ptr())
    _check(0 if count >= 0 else count, "root_leaves")
    return values, tokens, values


def best_known(tokens: Tensor, parents: Tensor, logq: Tensor, depth: Tensor, score: Tensor, f_score: Tensor,
               f_token: Tensor, f_logq: Tensor, budget: int, root_leaves: tuple | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """``tree.best_known`` (same arguments and result; among exactly equal keys the lowest index first)."""
    _need("best_known", (logq, score, f_score, f_logq, *(root_leaves or ())[::2]),
          (tokens, parents, depth, f_token, *(root_leaves or ())[1:2]))
    n = tokens.shape[0]
    leaf_score, leaf_token, leaf_logq = root_leaves if root_leaves is not None else (None, None, None)
    out = (torch.empty(budget, dtype=torch.long), torch.empty(budget, dtype=torch.long), torch.empty(budget))
    _check(_library().weaver_best_known(
        tokens.data_ptr(), parents.data_ptr(), logq.data_ptr(), depth.data_ptr(), score.data_ptr(),
        f_score.data_ptr(), f_token.data_ptr(), f_logq.data_ptr(), n, f_score.shape[0] // n,
        None if root_leaves is None else leaf_score.data_ptr(), None if root_leaves is None else leaf_token.data_ptr(),
        None if root_leaves is None else leaf_logq.data_ptr(), 0 if root_leaves is None else leaf_score.shape[0],
        budget, *(t.data_ptr() for t in out)), "best_known")
    return out


def spine_tree(query: Tensor, root: int | Tensor, pool_ids: Tensor, pool_rows: Tensor, pool_logits: Tensor,
               weight: Tensor, fan: int, children: int, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """The draft nodes of a spine tree with no rounds after the spine (``tree.weaver_tree_tensors`` with
    ``rounds=0``) from its one step's ``query [spine, d]`` (the root and the chain but its deepest node, ``spine``
    = ``pool_ids.shape[0]`` nodes): the pool scores, the expand, the root's leaves and the best-known pick in one
    call. ``pool_rows``: the ``weight`` row of each pool entry (``pool_ids``, or indices into a gathered copy)."""
    root = torch.as_tensor(root, dtype=torch.long).view(1)
    _need("spine_tree", (query, pool_logits, weight), (pool_ids, pool_rows, root))
    spine = pool_ids.shape[0]
    if (query.shape[0] != spine or pool_logits.dtype != torch.float32 or pool_logits.shape != pool_ids.shape
            or pool_rows.shape != pool_ids.shape):
        raise ValueError(f"spine_tree: a query row per spine node ({spine}) and fp32 pool logits shaped as the ids "
                         f"{tuple(pool_ids.shape)}; got {tuple(query.shape)}, {pool_logits.dtype} "
                         f"{tuple(pool_logits.shape)}")
    out = (torch.empty(budget, dtype=torch.long), torch.empty(budget, dtype=torch.long), torch.empty(budget))
    _check(_library().weaver_spine_tree(
        query.data_ptr(), _DTYPES[query.dtype], query.shape[1], root.data_ptr(), pool_ids.data_ptr(),
        pool_rows.data_ptr(), pool_logits.data_ptr(), pool_ids.shape[1], weight.data_ptr(), _DTYPES[weight.dtype],
        weight.shape[0], spine, fan, children, budget, *(t.data_ptr() for t in out)), "spine_tree")
    return out
