"""bnexp's config folders on Hydra's search path: the ``configs/`` folders of
``BNEXP_PLUGINS`` after bnexp's own, each read through :class:`ParsedOnceConfigSource`.

A plugin package with a ``configs/`` folder inside it adds its presets to the
groups of ``configs/`` (``configs/norm/<name>.yaml`` makes ``norm=<name>``), so a method
kept outside bnexp is its module and its config file (docs/architecture.md).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.config_source import ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin

from bnexp.support.registry import plugin_config_dirs

SCHEME = "bnexp-file"


class ParsedOnceConfigSource(FileConfigSource):
    """A config folder whose YAML files are parsed once per process for each content they
    have. Hydra parses every file a compose uses again at each compose: a third of the time
    of one, and a ``bnexp train`` composes at least three times (the command line's check,
    Hydra's mode and run), a sweep once more per job. Reading a file is cheap, so it is read
    each time and its bytes pick the parsed config; each caller gets its own copy, since
    Hydra edits what it loads."""

    _parsed: dict[tuple[str, bytes], ConfigResult] = {}

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def load_config(self, config_path: str) -> ConfigResult:
        full_path = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        try:
            key = (full_path, Path(full_path).read_bytes())
        except OSError:
            return super().load_config(config_path)  # Hydra's own "Config not found"
        if key not in self._parsed:
            result = super().load_config(config_path)
            if Path(full_path).read_bytes() != key[1]:  # changed while it was parsed
                return result
            self._parsed[key] = result
        return ConfigResult(provider=self.provider, path=f"{self.scheme()}://{self.path}",
                            config=copy.deepcopy(self._parsed[key].config), header=dict(self._parsed[key].header))


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
