"""bnexp's Hydra config tree: a Hydra session on it for ``compose``, the override parser,
and the config a completion query lists keys of."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.plugins import Plugins
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import Container, DictConfig, OmegaConf

from bnexp.app.config_tree import config_dir, register_resolvers
from bnexp.support.registry import plugin_config_dirs
from hydra_plugins.bnexp_searchpath import BnexpPluginConfigs, ParsedOnceConfigSource


@contextmanager
def hydra_session() -> Iterator[None]:
    """A Hydra context on bnexp's config tree (outside any running Hydra app), for ``compose``."""
    prepare_config_tree()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        yield


def parser() -> OverridesParser:
    """Hydra's override parser on bnexp's config tree (call inside :func:`hydra_session`)."""
    return OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())


def is_group(o: Override) -> bool:
    """Whether an override chooses a config group option (``norm=cbn``, ``hydra/launcher=joblib``),
    of bnexp's config tree or of a ``BNEXP_PLUGINS`` one."""
    key = o.key_or_group
    return key.startswith("hydra/") or ("." not in key and any((d / key).is_dir()
                                                               for d in (config_dir(), *plugin_config_dirs())))


def prepare_config_tree() -> None:
    """What composing bnexp's config tree needs besides the tree: its OmegaConf resolvers
    (:func:`bnexp.app.config_tree.register_resolvers`), the config source that parses each
    file once and the search-path plugin that reads bnexp's folders with it and adds the
    ``BNEXP_PLUGINS`` ones (registered by hand: an editable install hides ``hydra_plugins``
    from Hydra's own scan)."""
    Plugins.instance().register(ParsedOnceConfigSource)
    Plugins.instance().register(BnexpPluginConfigs)
    register_resolvers()


def completion_config(words: list[str]) -> Optional[dict[str, Any]]:
    """The config whose keys Hydra's completion of ``bnexp train WORDS <key>`` lists (``-m``
    first: a sweep's), composed as it composes it, as :func:`plain_config`: empty where Hydra
    cannot compose it (its completion then lists no keys); None where composing fails
    otherwise (Hydra's completion fails too), or :func:`plain_config` is None."""
    multirun = words[:1] in (["-m"], ["--multirun"])
    try:
        with hydra_session():
            cfg = GlobalHydra.instance().config_loader().load_configuration(
                config_name="train", overrides=words[1:] if multirun else words,
                run_mode=RunMode.MULTIRUN if multirun else RunMode.RUN)
    except ConfigCompositionException:
        return {}
    except Exception:  # Hydra's own completion fails as well: left to it
        return None
    return plain_config(cfg)


def plain_config(cfg: DictConfig) -> Optional[dict[str, Any]]:
    """``cfg`` as a JSON object (values unresolved, enums as names, number keys as text, as
    completion prints them); None where that would not show its keys as completion sees them
    (:func:`shown_as_seen`), or a value is not one JSON holds."""
    plain = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    if not shown_as_seen(cfg, plain):
        return None
    try:
        return json.loads(json.dumps(plain))
    except TypeError:  # a value JSON does not hold (a path)
        return None


def shown_as_seen(node: Container, plain: Any) -> bool:
    """Whether ``plain``, the container of ``node``, shows every config node under it as a
    dict or a list (one that is None or missing, ???, is a value there, which completion would
    list as a key to set, where Hydra lists a node) and every key as a string or a number
    holding a value (a word finds no node under a number key, which completion lists as text)."""
    if not isinstance(plain, (dict, list)):
        return False
    for key in node.keys() if isinstance(node, DictConfig) else range(len(plain)):
        child = node._get_node(key)
        if isinstance(node, DictConfig) and not (type(key) is str or (type(key) is int and not OmegaConf.is_config(child))):
            return False
        if OmegaConf.is_config(child) and not shown_as_seen(child, plain[key]):
            return False
    return True
