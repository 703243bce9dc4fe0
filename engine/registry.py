"""Registries with lazy imports: a name maps to `module:class` and the package it needs.

Attention and grammar backends are chosen this way (STYLE.md, 4): a backend's package is
imported only when that backend is chosen, and a missing one is named in the error.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# name: ("module:class", the package a user must install for it)
Registry = Mapping[str, tuple[str, str]]


def registered_class(registry: Registry, kind: str, name: str) -> Any:
    """The class that `registry` names `name`, imported now: ValueError for an unknown name,
    ImportError naming the package to install when its module does not import."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(registry)}")
    target, package = registry[name]
    module_name, cls_name = target.split(":")
    with needs_package(kind, name, package):
        module = importlib.import_module(module_name)
    return getattr(module, cls_name)


@contextmanager
def needs_package(kind: str, name: str, package: str) -> Iterator[None]:
    """Turns an ImportError inside into one that says which package `kind` `name` needs."""
    try:
        yield
    except ImportError as exc:
        raise ImportError(
            f"{kind} {name!r} needs the package {package!r} (pip install {package}): {exc}"
        ) from exc
