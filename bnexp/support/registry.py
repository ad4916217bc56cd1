"""A tiny name -> builder map shared by models, norms, activations and data sets, and the
discovery that fills the norm and model maps from their packages' modules.

A norm or model registers itself in the module that defines it (timm's ``@register_model``
idea). Those modules are found, not listed: the first lookup of a map made with a
``package`` imports every module of it (``bnexp/nn/``, ``bnexp/models/``), and every
lookup the modules named in ``BNEXP_PLUGINS``, so a new method is its own file and nothing
else in the code names it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import traceback
from pathlib import Path
from typing import Callable, Generic, Iterator, Optional, Sequence, TypeVar

from bnexp.support.errors import ConfigError, unknown_choice

T = TypeVar("T")

# Modules outside bnexp that register norms or models, comma-separated (docs/architecture.md).
PLUGINS_ENV = "BNEXP_PLUGINS"
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # a registered name
_OWN: list[Registry] = []  # the registries filled by bnexp's own packages (norms, models)


class Registry(Generic[T]):
    """Maps names to builders; lookups of unknown names list the valid ones. With a
    ``package``, every lookup first imports the modules that register: the package's, once,
    and those ``BNEXP_PLUGINS`` names (already imported ones cost a dict lookup, and a
    plugin named after the first lookup is still found)."""

    def __init__(self, kind: str, package: Optional[str] = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._package = package
        if package is not None:
            _OWN.append(self)

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that stores ``obj`` under ``name``: letters, digits and ``_`` (a name is a
        config value, and config files and run folders are named after it), not taken yet.
        A ConfigError otherwise: it comes from a plugin (bnexp's own names are fixed)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(f"{self.kind} name {name!r} is not valid: use letters, digits and _ (starting with a "
                              "letter), as bnexp's own names are")

        def add(obj: T) -> T:
            if name in self._items:
                raise ConfigError(f"{self.kind} {name!r} is registered already (by bnexp or another plugin): give "
                                  "the plugin's its own name")
            self._items[name] = obj
            return obj

        return add

    def import_own(self) -> None:
        """Import the modules of the package (once: a module registers as it is imported)."""
        if self._package is not None:
            package, self._package = self._package, None
            import_package_modules(package)

    def _discovered(self) -> dict[str, T]:
        self.import_own()
        if plugins := plugin_names():
            import_plugins(plugins)
        return self._items

    def get(self, name: str) -> T:
        """The builder registered under ``name``; ConfigError if there is none."""
        items = self._discovered()
        try:
            return items[name]
        except KeyError:
            raise unknown_choice(self.kind, name, items) from None

    def names(self) -> list[str]:
        return sorted(self._discovered())

    def __contains__(self, name: object) -> bool:
        return name in self._discovered()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def import_package_modules(package: str) -> None:
    """Import every module of ``package`` (each registers what it defines)."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")


def plugin_names() -> list[str]:
    """The modules ``BNEXP_PLUGINS`` names."""
    return [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]


def import_plugins(names: Sequence[str]) -> None:
    """Import the modules of ``BNEXP_PLUGINS``; one that cannot be imported (not found, a
    SyntaxError, an error its code raises, a name a registry refuses) is a ConfigError naming
    it and where it failed."""
    for registry in list(_OWN):  # bnexp's own names first: a name a plugin takes again is the plugin's error
        registry.import_own()
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(f"{PLUGINS_ENV}={os.environ[PLUGINS_ENV]}: cannot import {name!r} ({err}); name "
                              "importable modules (on PYTHONPATH), separated by commas") from None
        except Exception as err:  # the module's own code failed (SyntaxError is an Exception too)
            raise ConfigError(f"{PLUGINS_ENV}={os.environ[PLUGINS_ENV]}: the plugin {name!r} failed as it was "
                              f"imported{failed_at(err)}: {type(err).__name__}: {' '.join(str(err).split())}; fix it, "
                              f"or leave it out of {PLUGINS_ENV}") from None


def failed_at(err: Exception) -> str:
    """`` (file, line N)``: where a plugin's import failed, in the plugin's own code."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" ({err.filename}, line {err.lineno})"
    own = Path(__file__).resolve().parents[1]  # bnexp's package: its frames (a registry refusing) are not the plugin's
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith("<") and own not in Path(f.filename).resolve().parents]
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def plugin_config_dirs() -> list[Path]:
    """The ``configs/`` folders inside the ``BNEXP_PLUGINS`` packages, which bnexp's config
    search path adds after its own (a plain module has none: the folder beside a module
    file, site-packages say, is not the plugin's)."""
    names = plugin_names()
    import_plugins(names)
    folders = [Path(p) / "configs" for name in names for p in getattr(importlib.import_module(name), "__path__", [])]
    return [f for f in folders if f.is_dir()]
