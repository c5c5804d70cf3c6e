"""Picking a module by name: the models, data sets and tasks are the modules of their package
that provide the functions of their kind (`models`, `data`, `experiments`). Imports nothing of
ours."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def modules_providing(package: str, path, functions: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the modules (files or folders) of `package` (its `__path__`, `path`) that
    define every one of `functions`, sorted; modules whose name starts with "_" are left out."""
    names = []
    for info in pkgutil.iter_modules(path):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{package}.{info.name}")
            if provides(module, functions):
                names.append(info.name)
    return tuple(sorted(names))


def provides(module: ModuleType, functions: tuple[str, ...]) -> bool:
    """Whether `module` defines every one of `functions` as a callable."""
    return all(callable(getattr(module, name, None)) for name in functions)
