"""bnexp's config folders on Hydra's search path: the ``configs/`` folders of
``BNEXP_PLUGINS`` after bnexp's own, each read through :class:`ParsedOnceConfigSource`.

A plugin package with a ``configs/`` folder inside it adds its presets to the
groups of ``configs/`` (``configs/norm/<name>.yaml`` makes ``norm=<name>``), so a method
kept outside bnexp is its module and its config file (docs/architecture.md).
"""

from __future__ import annotations

import copy
import os

from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.config_source import ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin

from bnexp.support.registry import plugin_config_dirs

SCHEME = "bnexp-file"


class ParsedOnceConfigSource(FileConfigSource):
    """A config folder whose YAML files are parsed once per process (and again when a file
    changes). Hydra parses every file a compose uses again at each compose: a third of the
    time of one, and a ``bnexp train`` composes at least three times (the command line's
    check, Hydra's mode and run), a sweep once more per job. Each caller gets its own copy,
    since Hydra edits what it loads."""

    _parsed: dict[tuple[str, int, int], ConfigResult] = {}

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        full_path = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        try:
            stat = os.stat(full_path)
        except OSError:
            return super().load_config(config_path)  # Hydra's own "Config not found"
        key = (full_path, stat.st_mtime_ns, stat.st_size)
        if key not in self._parsed:
            self._parsed[key] = super().load_config(config_path)
        done = self._parsed[key]
        return ConfigResult(provider=done.provider, path=done.path, config=copy.deepcopy(done.config),
                            header=dict(done.header))


def parsed_once(path: str) -> str:
    """``path`` (a folder, or a file:// address) as an address of :class:`ParsedOnceConfigSource`."""
    return f"{SCHEME}://{path.removeprefix('file://')}"


class BnexpPluginConfigs(SearchPathPlugin):
    """Reads bnexp's config folder (the app's, ``main``) with :class:`ParsedOnceConfigSource`
    and appends each plugin's ``configs/`` folder to the search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for element in search_path.get_path():
            if element.provider == "main" and "://" not in element.path.removeprefix("file://"):
                element.path = parsed_once(element.path)
        for folder in plugin_config_dirs():
            search_path.append(provider="bnexp-plugin", path=parsed_once(str(folder)))
