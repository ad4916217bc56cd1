"""Where bnexp's config tree is, and the shell completion of a config group's options, without
importing Hydra: each TAB press starts a process, and Hydra's import alone takes most of the
half second a completion may take (docs/benchmarks.md).

:func:`group_choices` answers the commonest query, ``bnexp train ... norm=cb<TAB>``, as
Hydra's bash completion would (the ``.yaml`` files directly in the group's folder, as
``group=option``, sorted); every other line is left to Hydra, which bnexp's completion then runs.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Optional

from bnexp.support.registry import PLUGINS_ENV

# The last word of a line this module answers: a top-level group and the start of an option.
GROUP_WORD = re.compile(r"(?P<group>[A-Za-z_][\w-]*)=(?P<start>[^=\s]*)")
# The other words it accepts: plain overrides (no brackets, quotes or interpolations) and -m.
PLAIN_WORD = re.compile(r"[+~]?[A-Za-z_][\w./-]*=[\w.,:/-]*|-m|--multirun")


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


def group_choices(words: str) -> Optional[str]:
    """Hydra's bash answer to a completion query of ``bnexp train WORDS`` whose last word is
    ``group=start`` for a group folder of bnexp's config tree that holds configs: the options
    beginning so, space-separated. None for any other line, where the other words are not
    plain overrides, or with ``BNEXP_PLUGINS`` (whose config folders Hydra's search path adds)."""
    if os.environ.get(PLUGINS_ENV) or not words.strip() or words.endswith(" "):
        return None
    *others, last = words.split()
    word = GROUP_WORD.fullmatch(last)
    if word is None or word["group"] == "hydra" or not all(PLAIN_WORD.fullmatch(w) for w in others) \
            or any(w.lstrip("+~").startswith("hydra") for w in others):
        return None
    folder = config_dir() / word["group"]
    options = group_configs(folder) if folder.is_dir() else []
    if not options:  # Hydra goes on to the config's keys
        return None
    return " ".join(f"{word['group']}={o}" for o in options if f"{word['group']}={o}".startswith(last))
