"""The command lines' shared parts: argparse types that refuse a bad flag in one line, and JSON without NaN.

``python -m sparse_ref.demo``, ``sparse_ref.demo_tp`` and ``python -m sparse_ref.bench`` use them; the decode step
never does (its checks live in ``checks.py``).
"""
from __future__ import annotations

import math


def cli_parser(prog: str, description: str):
    """An ``argparse.ArgumentParser`` whose errors are one line naming the flag (no usage dump), exit status 2.
    Under torchrun every rank parses the same flags: only rank 0 prints the line, every rank exits 2."""
    import argparse

    class OneLineErrors(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n" if is_rank_zero() else None)

    return OneLineErrors(prog=prog, description=description)


def is_rank_zero() -> bool:
    """True outside torchrun, and on its rank 0 (torchrun sets ``RANK`` in every process it starts)."""
    import os

    return os.environ.get("RANK", "0") == "0"


def cli_positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (``--context 0`` or ``--steps -3`` exit 2 naming the flag)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def cli_output_file(text: str):
    """An argparse type: a file path that can be written, not a folder, not empty. The folders are made and a
    file is written there as a probe (permissions alone do not tell: root passes every permission, and /proc or a
    read-only mount still refuse), then both are removed again: a command refused later leaves no trace."""
    import argparse
    import os
    import tempfile
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got an empty string")
    path = Path(text).resolve()  # ".." taken before any folder is made ("a/missing/../b": "a/b")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got the folder {text!r}")
    existing = next(p for p in (path.parent, *path.parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create a folder under {str(existing)!r}: it is a file")
    made = [p for p in path.parents if not p.exists()]
    try:
        for folder in reversed(made):
            folder.mkdir()
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(f"{text!r} is read-only")
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".probe-"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r} ({e.strerror or e}). Fix: choose a folder you "
                                         "can write, e.g. build/") from None
    finally:
        for folder in made:  # deepest first; only the folders made here
            if folder.exists():
                folder.rmdir()
    return path


def cli_environment(parser) -> None:
    """The environment switches a command reads (``SPARSE_REF_FAST``, ``SPARSE_REF_CAPABILITY``) checked before any
    work: a bad value exits 2 with its one-line message, not a traceback."""
    import torch

    from sparse_ref.backend import capability
    from sparse_ref.device import fast_mode
    from sparse_ref.errors import SparseRefError

    try:
        fast_mode()
        capability(torch.device("cpu"))  # (the switch is read before the device)
    except SparseRefError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n" if is_rank_zero() else None)


def cli_image_file(text: str):
    """An argparse type: ``cli_output_file`` whose suffix names an image format matplotlib writes (png, pdf, ...)."""
    import argparse

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = cli_output_file(text)
    formats = sorted(FigureCanvasAgg(Figure()).get_supported_filetypes())
    if path.suffix.lstrip(".").lower() not in formats:
        raise argparse.ArgumentTypeError(f"expected an image file ending in one of .{', .'.join(formats)}, "
                                         f"got {text!r}")
    return path


def json_safe(value):
    """``value`` with every NaN and infinity replaced by None, so ``json.dumps(..., allow_nan=False)`` writes valid
    JSON (bare ``NaN`` is not JSON: strict parsers refuse the whole file)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
