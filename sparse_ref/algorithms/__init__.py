"""Sparse algorithms and their registry: ``create_sparse_algorithm(name, config, device)``.

A registry entry is either a class or a ``"module:Class"`` string imported on first use, so
an algorithm with heavy or optional dependencies (DSA) costs nothing until it is asked for.
"""

from __future__ import annotations

import importlib
import inspect

from sparse_ref.algorithms.base import SparseAlgorithm
from sparse_ref.algorithms.quest import QuestAlgorithm
from sparse_ref.checks import describe, fail
from sparse_ref.errors import ConfigError, UnknownAlgorithmError

_REGISTRY: dict[str, type | str] = {
    "quest": QuestAlgorithm,
    "deepseek_dsa": "sparse_ref.algorithms.dsa:DSAAlgorithm",
}


def known_algorithms() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def register_sparse_algorithm(name: str, cls: type | str) -> None:
    """Add (or replace) a registry entry: a SparseAlgorithm subclass or a ``"module:Class"`` path."""
    if not isinstance(name, str) or not name:
        fail("name", "a non-empty str", describe(name), error=ConfigError)
    if not (isinstance(cls, type) and issubclass(cls, SparseAlgorithm)) and not (isinstance(cls, str) and ":" in cls):
        fail("cls", "a SparseAlgorithm subclass or a 'module:Class' path", describe(cls), error=ConfigError)
    _REGISTRY[name] = cls


def _resolve(name: str) -> type:
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise UnknownAlgorithmError(
                f"Unknown sparse algorithm: {name}. Its registry entry {entry!r} does not import "
                f"({type(e).__name__}: {e}). Fix: register_sparse_algorithm({name!r}, cls) with an importable "
                "'module:Class' path or the class itself."
            ) from e
    return entry


def create_sparse_algorithm(name: str, config=None, device="cpu", **kwargs):
    """Build the algorithm registered under ``name`` with ``config`` on ``device``.

    An unknown name raises UnknownAlgorithmError (SGLang's message, then the known names).
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise UnknownAlgorithmError(
            f"Unknown sparse algorithm: {name}. Known algorithms: {', '.join(known_algorithms())}. "
            "Fix: pass one of these names, or register a new class with register_sparse_algorithm(name, cls)."
        )
    cls = _resolve(name)
    try:
        inspect.signature(cls).bind(config, device, **kwargs)
    except TypeError as e:
        fail("create_sparse_algorithm(**kwargs)", f"arguments of {cls.__name__}{inspect.signature(cls)}",
             f"{sorted(kwargs)} ({e})", error=ConfigError)
    return cls(config, device, **kwargs)


__all__ = [
    "QuestAlgorithm",
    "SparseAlgorithm",
    "create_sparse_algorithm",
    "known_algorithms",
    "register_sparse_algorithm",
]
