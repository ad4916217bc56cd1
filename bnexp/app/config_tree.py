"""Where bnexp's config tree is, its groups and the OmegaConf resolvers it uses, a digest of what
composing it reads, and the shell completion of a config group's options and of a config key,
all without importing Hydra: each TAB press starts a process, and Hydra's import alone takes
most of the half second a completion may take (docs/benchmarks.md).

:func:`group_choices` answers the commonest query, ``bnexp train ... norm=cb<TAB>``, as
Hydra's bash completion would (the ``.yaml`` files directly in the group's folder, as
``group=option``, sorted). :func:`key_choices` answers a dotted key, ``bnexp train ...
norm.r<TAB>``, from the config the other words compose, kept in bnexp's cache folder under
:func:`config_digest` (composed by Hydra on a miss). Every other line is left to Hydra, which
bnexp's completion then runs.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional

from bnexp.support.cache import cache_dir, package_digest, package_dir, tree_digest, write_cache
from bnexp.support.registry import PLUGINS_ENV, plugin_config_dirs
from bnexp.support.untrusted import RECORD_FILE, read_regular

# The last word of a line this module answers: a top-level group and the start of an option.
GROUP_WORD = re.compile(r"(?P<group>[A-Za-z_][\w-]*)=(?P<start>[^=\s]*)")
# The other words it accepts: plain overrides (no brackets, quotes or interpolations) and -m.
PLAIN_WORD = re.compile(r"[+~]?[A-Za-z_][\w./-]*=[\w.,:/-]*|-m|--multirun")
MULTIRUN = ("-m", "--multirun")
# The last word of a line whose keys this module completes: a config key with a dot, being typed.
KEY_WORD = re.compile(r"[A-Za-z_][\w-]*(?:\.[\w-]+)*\.[\w-]*")
# An other word that sets a value (a dotted key, a plain value, no sweep): where the config of
# the line without it holds a value there, it changes no key, and that config answers.
VALUE_WORD = re.compile(r"(?P<key>[A-Za-z_]\w*(?:\.\w+)+)=[\w.-]*")
ABSENT = object()  # no such key in a config node


def config_dir() -> Path:
    """``configs/`` of a source checkout, else the copy installed as ``bnexp.configs``."""
    checkout = Path(__file__).resolve().parents[2] / "configs"
    if (checkout / "train.yaml").is_file():
        return checkout
    return Path(str(resources.files("bnexp.configs")))


def group_configs(folder: Path) -> list[str]:
    """The configs of a group folder as Hydra lists them: its ``.yaml`` files (links followed),
    without the extension, sorted."""
    return sorted({name.rsplit(".", 1)[0] for name in os.listdir(folder)
                   if name.endswith(".yaml") and os.path.isfile(os.path.realpath(folder / name))})


# Groups that presets and train.yaml choose, never a command line: left out of `bnexp train --help`.
INTERNAL_GROUPS = ("hydra", "protocol", "norm_defaults_layer", "sweep")


def group_options(group: str) -> list[str]:
    """The options of a config group, bnexp's and the ``BNEXP_PLUGINS`` ones (``experiment``:
    ``cbn/table1``, ...)."""
    roots = [root / group for root in (config_dir(), *plugin_config_dirs())]
    return sorted({str(p.relative_to(root).with_suffix("")) for root in roots for p in root.rglob("*.yaml")})


def help_groups() -> str:
    """``bnexp train --help``'s list of config groups and their options, one group a line,
    without the :data:`INTERNAL_GROUPS` (configs/hydra/help/bnexp.yaml)."""
    groups = {p.name for root in (config_dir(), *plugin_config_dirs()) for p in root.iterdir()
              if p.is_dir() and not p.name.startswith(("_", ".")) and p.name not in INTERNAL_GROUPS}
    return "\n".join(f"{group}: {', '.join(group_options(group))}" for group in sorted(groups))


def register_resolvers() -> None:
    """Register the OmegaConf resolvers bnexp's config tree uses, once per process:
    ``${run_name:...}``, ``${cell_dir:...}``, ``${cell_name:...}`` (the sweep cells' folder
    before ``cell_dir``, for configs that name it), ``${bnp_lr:...}``, ``${help_groups:}`` and
    ``${sweep_name:...}``. Hydra composes with them; a config read back from the cache folder
    resolves with them, without Hydra."""
    from omegaconf import OmegaConf  # here: completion from the cache does without it

    from bnexp.app.cells import cell_dir
    from bnexp.engine.identity import cell_name, run_name
    from bnexp.reference import bnp_lr

    resolvers = (("run_name", run_name), ("cell_dir", cell_dir), ("cell_name", cell_name), ("bnp_lr", bnp_lr),
                 ("help_groups", help_groups))
    for name, resolver in resolvers:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
    # A sweep's folder is named once, from the sweep's command line: Hydra copies a cached
    # value into every job's config (as it does for ${now:...}), where hydra.overrides.task
    # holds the job's overrides instead.
    if not OmegaConf.has_resolver("sweep_name"):
        OmegaConf.register_new_resolver("sweep_name", run_name, use_cache=True)


def group_choices(words: str) -> Optional[str]:
    """Hydra's bash answer to a completion query of ``bnexp train WORDS`` whose last word is
    ``group=start`` for a group folder of bnexp's config tree that holds configs: the options
    beginning so, space-separated. None for any other line, where the other words are not
    plain overrides, or with ``BNEXP_PLUGINS`` (whose config folders Hydra's search path adds)."""
    if os.environ.get(PLUGINS_ENV) or not words.strip() or words.endswith(" "):
        return None
    *others, last = words.split()
    word = GROUP_WORD.fullmatch(last)
    if word is None or word["group"] == "hydra" or not plain_overrides(others):
        return None
    folder = config_dir() / word["group"]
    options = group_configs(folder) if folder.is_dir() else []
    if not options:  # Hydra goes on to the config's keys
        return None
    return " ".join(f"{word['group']}={o}" for o in options if f"{word['group']}={o}".startswith(last))


def plain_overrides(words: list[str]) -> bool:
    """Whether ``words`` are plain overrides (no brackets, quotes or interpolations; ``-m``
    allowed) of the app's config, none of Hydra's own (``hydra.``, ``hydra/``)."""
    return all(PLAIN_WORD.fullmatch(w) and not w.lstrip("+~").startswith("hydra") for w in words)


def hydra_plugin_dirs() -> list[Path]:
    """The ``hydra_plugins`` folders whose plugins Hydra loads (their code registers configs,
    of sweepers and launchers, in Hydra's config store): bnexp's and every other one on the
    import path."""
    spec = importlib.util.find_spec("hydra_plugins")
    found = [Path(p) for p in (spec.submodule_search_locations or []) if Path(p).is_dir()] if spec else []
    return sorted({*found, package_dir().parent / "hydra_plugins"})


@functools.cache
def composer_versions() -> tuple[str, str]:
    """The installed versions of Hydra and OmegaConf, looked up once per process (each lookup
    searches the import path's package records)."""
    from importlib import metadata  # here: a group's completion need not import it (40 ms)

    return metadata.version("hydra-core"), metadata.version("omegaconf")


def config_digest(*parts: Any) -> str:
    """A digest of ``parts`` (JSON values: what is composed) and everything else a composition
    of the config tree reads: every file of its search path (bnexp's tree, the ``BNEXP_PLUGINS``
    config folders, the Hydra plugins), bnexp's own files (code, the resolvers' tables) and the
    versions of Hydra and OmegaConf."""
    digest = hashlib.sha256(json.dumps([*parts, os.environ.get(PLUGINS_ENV, ""), *composer_versions()]).encode())
    digest.update(package_digest().encode())
    tree_digest(digest, (config_dir(), *plugin_config_dirs(), *hydra_plugin_dirs()))
    return digest.hexdigest()[:32]


def key_choices(words: str, compose: Callable[[list[str]], Optional[dict[str, Any]]]) -> Optional[str]:
    """Hydra's bash answer to a completion query of ``bnexp train WORDS`` whose last word is a
    config key with a dot (``norm.r``, ``hydra.run.``) and whose other words are plain
    overrides (after ``-m``, for a sweep's config): the keys :func:`key_matches` finds in the
    config the other words compose (:func:`line_config`), sorted, space-separated. None for
    any other line, and where the answer depends on a value: Hydra answers those."""
    if not words.strip() or words.endswith(" "):
        return None
    *others, last = words.split()
    overrides = others[1:] if others[:1] and others[0] in MULTIRUN else others
    if not KEY_WORD.fullmatch(last) or not plain_overrides(overrides) or set(MULTIRUN) & set(overrides):
        return None
    config = line_config(others, compose)
    matches = None if config is None else key_matches(config, last)
    return None if matches is None else " ".join(sorted(set(matches)))


def line_config(words: list[str], compose: Callable[[list[str]], Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """The config whose keys a completion after ``words`` lists: that of the words without
    the ones that set values (:data:`VALUE_WORD`) where it holds a value at each of their keys
    (setting one changes no key: bnexp's configs are untyped YAML, so composing cannot fail
    on a value), else that of all the words; from the cache (:func:`cached_config`)."""
    values = [w for w in words if VALUE_WORD.fullmatch(w)]
    if values:
        config = cached_config([w for w in words if w not in values], compose)
        if config is not None and all(holds_value(config, w.partition("=")[0]) for w in values):
            return config
    return cached_config(words, compose)


def holds_value(config: dict[str, Any], key: str) -> bool:
    """Whether the dotted ``key`` names a value of ``config`` (not a node), through dicts only."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return not isinstance(node, (dict, list))


def cached_config(words: list[str], compose: Callable[[list[str]], Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """The config ``compose(words)`` gives (a JSON object, or None), from bnexp's cache folder
    when it holds it under the same :func:`config_digest` (a missing, unreadable or foreign
    file is not used), else composed and kept there; without a cache folder, composed each
    time."""
    try:
        path: Optional[Path] = cache_dir() / "completion" / f"{config_digest('completion', words)}.json"
    except OSError:  # no home folder to keep a cache in
        path = None
    config = read_config(path) if path is not None else None
    if config is not None:
        return config
    composed = compose(words)
    if composed is not None and path is not None:
        try:
            write_cache(path, json.dumps(composed).encode())
        except OSError:
            pass
    return composed


def read_config(path: Path) -> Optional[dict[str, Any]]:
    """The config a cache file holds; None when it is missing, unreadable or not a JSON object."""
    try:
        config = json.loads(read_regular(path, RECORD_FILE))
    except (OSError, ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None


def key_matches(config: dict[str, Any], word: str) -> Optional[list[str]]:
    """Hydra's matches of a key ``word`` with a dot in a composed config
    (``CompletionPlugin._get_matches``), on its plain container (a dict or list is a config
    node, anything else a value): under the node the part before the last dot names, each key
    beginning with the part after it, a node's followed by ``.`` and a value's by ``=``; none
    where no such node is. None where Hydra's answer depends on a value, which Hydra resolves
    or prints: the node is a value, or the path crosses one, or a list holds an interpolation."""
    base, _, start = word.rpartition(".")
    node: Any = config
    for part in base.split("."):
        if isinstance(node, dict):
            node = node.get(part, ABSENT)
        elif isinstance(node, list) and part.isascii() and part.isdigit():
            node = node[int(part)] if int(part) < len(node) else ABSENT
        else:  # a value (OmegaConf's select resolves an interpolation there), or a list's key not a number
            return None
        if node is ABSENT:
            return []
    if isinstance(node, dict):
        found = [(key, value) for key, value in node.items() if key.startswith(start)]
    elif isinstance(node, list) and not any(isinstance(item, str) and "${" in item for item in node):
        # Hydra reads each item, and lists a missing one (???) whatever the word
        found = [(str(i), item) for i, item in enumerate(node) if str(i).startswith(start) or item == "???"]
    else:
        return None
    return [f"{base}.{key}{'.' if isinstance(value, (dict, list)) else '='}" for key, value in found]

