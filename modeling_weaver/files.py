"""Files read without executing code: ``torch.save``d dicts (training shards and states, released Weaver ``.pth``
checkpoints) through one loader whose errors name the file."""

from __future__ import annotations

import torch

__all__ = ["load_dict_file"]


def load_dict_file(file, what: str, fields, map_location="cpu", error: type[ValueError] = ValueError) -> dict:
    """A ``torch.save``d dict read with ``weights_only=True`` (a pickle that names any callable is refused); errors
    (``error``, a ValueError) name the file and what it should have been. The caller checks the fields."""
    try:
        obj = torch.load(file, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - pickles that need code, truncated or foreign files, ...
        raise error(f"{file}: not {what} ({type(err).__name__}: {' '.join(str(err).split())[:300]})") from err
    if not isinstance(obj, dict):
        raise error(f"{file}: expected a dict of {', '.join(fields)}, found {type(obj).__name__}")
    return obj
