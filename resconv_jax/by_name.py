"""Picking a module by name: the models, data sets and tasks are the modules of their package
that provide the functions of their kind (`models`, `data`, `experiments`). Imports nothing of
ours."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def package_modules(package: str, path) -> list[ModuleType]:
    """The modules (files or folders) of `package` (its `__path__`, `path`), imported; those whose
    name starts with "_" are left out."""
    return [
        importlib.import_module(f"{package}.{info.name}")
        for info in pkgutil.iter_modules(path)
        if not info.name.startswith("_")
    ]


def modules_providing(package: str, path, functions: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the modules of `package` (`package_modules`) that define every one of
    `functions`, sorted."""
    return tuple(
        sorted(
            module.__name__.rpartition(".")[2]
            for module in package_modules(package, path)
            if provides(module, functions)
        )
    )


def import_named(package: str, name: str, names: tuple[str, ...], refusal: Exception) -> ModuleType:
    """The module `package.name` when `name` is one of `names`; else raises `refusal`."""
    if name not in names:
        raise refusal
    return importlib.import_module(f"{package}.{name}")


def import_providing(
    package: str, path, name: str, functions: tuple[str, ...]
) -> ModuleType | None:
    """The module `package.name` if it exists and defines every one of `functions`, importing no
    other module of the package; None otherwise."""
    names = {info.name for info in pkgutil.iter_modules(path) if not info.name.startswith("_")}
    if name not in names:
        return None
    module = importlib.import_module(f"{package}.{name}")
    return module if provides(module, functions) else None


def provides(module: ModuleType, functions: tuple[str, ...]) -> bool:
    """Whether `module` defines every one of `functions` as a callable."""
    return all(callable(getattr(module, name, None)) for name in functions)
