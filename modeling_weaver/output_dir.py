"""Output folders of the commands that write (convert, export, fetch-smollm2): nothing of the user's is ever deleted.

Every folder we write is built in a fresh temporary folder beside the destination and renamed into place once
complete, carrying a marker file (:data:`MARKER`). An existing non-empty destination is replaced only with
``overwrite=True`` and only when it carries that marker; a destination that overlaps an input (equal, inside it, or
holding it, symlinks resolved) is refused. Folders get the permissions of a plain ``mkdir`` (the umask decides).
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["MARKER", "OutputOverlapError", "check_output", "is_our_output", "written_output"]

#: Present in every folder this package writes; only such a folder may be replaced.
MARKER = ".modeling_weaver_output"
_MARKER_TEXT = "Written by modeling-weaver. `weaver ... --overwrite` may replace this folder; it replaces no other.\n"


class OutputOverlapError(ValueError):
    """The output folder is an input, lies inside one, or holds one."""


def is_our_output(folder) -> bool:
    return (Path(folder) / MARKER).is_file()


def _overlap(out: Path, inputs: Iterable) -> Path | None:
    for item in inputs:
        if item is None or not os.path.exists(item):  # Hub ids and absent options cannot be overwritten
            continue
        src = Path(item).resolve()
        if src == out or src in out.parents or out in src.parents:
            return Path(item)
    return None


def check_output(out, inputs: Iterable = (), overwrite: bool = False) -> Path:
    """Refuse ``out`` before any work: it overlaps an input, is not a folder, or is a non-empty folder that we may not
    replace (no ``overwrite``, or no :data:`MARKER`). Returns ``out`` with symlinks resolved."""
    out = Path(out).resolve()
    clash = _overlap(out, inputs)
    if clash is not None:
        raise OutputOverlapError(f"the output folder {out} overlaps the input {clash} (one holds the other, symlinks "
                                 "resolved): write the output somewhere else")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite)")
        if not is_our_output(out):
            raise FileExistsError(f"{out} is not a folder written by modeling-weaver (no {MARKER} file): --overwrite "
                                  "replaces only our own output; choose another folder or empty it yourself")
    return out


@contextmanager
def written_output(out, inputs: Iterable = (), overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out`` to write into; on success it is marked and renamed to ``out``
    (replacing the old output only then), on failure it is removed and ``out`` is left as it was.

    ``inputs``: paths the output must not overlap (checked by :func:`check_output` before anything is written).
    """
    inputs = list(inputs)
    out = check_output(out, inputs, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # mode 0o777 & ~umask, unlike tempfile.mkdtemp's 0o700
    try:
        yield tmp
        (tmp / MARKER).write_text(_MARKER_TEXT)
        check_output(out, inputs, overwrite)  # the destination may have changed while we wrote
        _swap_in(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _swap_in(tmp: Path, out: Path) -> None:
    if not out.is_dir() or not any(out.iterdir()):
        os.replace(tmp, out)  # a missing or empty folder is replaced in one rename
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)  # a marked folder of ours (check_output)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old)
