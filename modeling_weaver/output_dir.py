"""Output folders and files of the commands that write: nothing of the user's is ever deleted or overwritten.

Every folder we write (convert, export, fetch-smollm2, bench, replay, ...) is built in a fresh temporary folder
beside the destination and renamed into place once complete, carrying a marker file (:data:`MARKER`). An existing
non-empty destination is replaced only with ``overwrite=True`` and only when it carries that marker; a destination
that overlaps an input (equal, inside it, or holding it, symlinks resolved) is refused. Folders get the permissions of
a plain ``mkdir`` (the umask decides). Commands that add files to a folder they share with other runs (make-data's
tagged files, a script's single output file) refuse a name that already exists (:func:`check_new_files`). Code
files copied into a Hub folder start with a "generated — do not edit" line naming their source (:func:`with_banner`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["CACHE_ENV", "MARKER", "OutputOverlapError", "cache_root", "check_new_files", "check_output",
           "is_our_output", "stamp_code_copies", "with_banner", "written_output"]

#: The environment variable naming the cache folder (models, evaluation data, measured step costs).
CACHE_ENV = "MODELING_WEAVER_CACHE"


def cache_root() -> Path:
    """``$MODELING_WEAVER_CACHE`` or ``~/.cache/modeling_weaver``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "modeling_weaver"


#: Present in every folder this package writes; only such a folder may be replaced.
MARKER = ".modeling_weaver_output"
_MARKER_TEXT = "Written by modeling-weaver. `weaver ... --overwrite` may replace this folder; it replaces no other.\n"


#: First line of every code file copied into a Hub folder (``{source}``: the file it is a copy of).
BANNER = "# Generated from {source} — do not edit; edit the source and run `weaver export`.\n"
_BANNER_START, _BANNER_END = BANNER.split("{source}")


def with_banner(text: str, source: str) -> str:
    """``text`` with the banner naming ``source`` as its first line; a banner already there is replaced, so a copy of a
    copy carries one. A comment may precede ``from __future__`` imports and the module docstring."""
    first, _, rest = text.partition("\n")
    if first.startswith(_BANNER_START) and first.endswith(_BANNER_END.rstrip("\n")):
        text = rest
    return BANNER.format(source=source) + text


def stamp_code_copies(folder) -> None:
    """Put the banner on the package's code files that ``save_pretrained`` copied into ``folder`` (its ``*.py`` named
    like a module of this package)."""
    package = Path(__file__).resolve().parent
    for path in sorted(Path(folder).glob("*.py")):
        if (package / path.name).is_file():
            path.write_text(with_banner(path.read_text(encoding="utf-8"), f"modeling_weaver/{path.name}"),
                            encoding="utf-8")


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


def check_output(out, inputs: Iterable = (), overwrite: bool = False, flag: str | None = "--overwrite") -> Path:
    """Refuse ``out`` before any work: it overlaps an input, is not a folder, or is a non-empty folder that we may not
    replace (no ``overwrite``, or no :data:`MARKER`). ``flag``: the command's option that sets ``overwrite``, named in
    the refusal (None: it has none). Returns ``out`` with symlinks resolved."""
    out = Path(out).resolve()
    clash = _overlap(out, inputs)
    if clash is not None:
        raise OutputOverlapError(f"the output folder {out} overlaps the input {clash} (one holds the other, symlinks "
                                 "resolved): write the output somewhere else")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            how = f"pass {flag} to replace our own earlier output there, or choose another folder" if flag else (
                "choose another folder")
            raise FileExistsError(f"{out} exists and is not empty: {how}")
        if not is_our_output(out):
            raise FileExistsError(f"{out} is not a folder written by modeling-weaver (no {MARKER} file): {flag} "
                                  "replaces only our own output; choose another folder or empty it yourself")
    return out


def check_new_files(paths: Iterable, hint: str) -> None:
    """Refuse before any work when a file this command would create already exists (``hint``: what to do instead)."""
    taken = [str(p) for p in paths if os.path.lexists(p)]
    if taken:
        raise FileExistsError(f"{', '.join(taken)} already exist{'s' if len(taken) == 1 else ''}: {hint}")


@contextmanager
def written_output(out, inputs: Iterable = (), overwrite: bool = False, flag: str | None = "--overwrite",
                   keep_partial: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out`` to write into; on success it is marked and renamed to ``out``
    (replacing the old output only then), on failure it is removed and ``out`` is left as it was.

    ``inputs``: paths the output must not overlap (checked by :func:`check_output` before anything is written).
    ``keep_partial``: on failure or interrupt, what was written so far still goes to ``out`` (a benchmark's rows).
    """
    inputs = list(inputs)
    out = check_output(out, inputs, overwrite, flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # mode 0o777 & ~umask, unlike tempfile.mkdtemp's 0o700
    finished = False
    try:
        yield tmp
        finished = True
    finally:
        try:
            if tmp.exists() and (finished or keep_partial and any(tmp.iterdir())):
                (tmp / MARKER).write_text(_MARKER_TEXT)
                check_output(out, inputs, overwrite, flag)  # the destination may have changed while we wrote
                _swap_in(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)


def _swap_in(tmp: Path, out: Path) -> None:
    if not out.is_dir() or not any(out.iterdir()):
        os.replace(tmp, out)  # a missing or empty folder is replaced in one rename
        return
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(out, old)  # a marked folder of ours (check_output); until the next rename succeeds, it is the output
    try:
        os.replace(tmp, out)
    except BaseException as err:
        try:
            os.replace(old, out)
        except BaseException:
            raise OSError(f"replacing {out} failed ({err}) and so did putting the old output back: it is in {old}")
        raise
    shutil.rmtree(old)  # only now is the new output complete in place
