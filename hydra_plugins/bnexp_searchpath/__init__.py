"""The config folders of ``BNEXP_PLUGINS`` on Hydra's search path, after bnexp's own.

A plugin package with a ``configs/`` folder inside it adds its presets to the
groups of ``configs/`` (``configs/norm/<name>.yaml`` makes ``norm=<name>``), so a method
kept outside bnexp is its module and its config file (docs/architecture.md).
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from bnexp.support.registry import plugin_config_dirs


class BnexpPluginConfigs(SearchPathPlugin):
    """Appends each plugin's ``configs/`` folder to the search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for folder in plugin_config_dirs():
            search_path.append(provider="bnexp-plugin", path=f"file://{folder}")
