"""Print bnexp's dependencies (its dev extra included) except torch and torchvision, one per
line: what `make wheels` gathers for a GPU node that has its own CUDA build of PyTorch."""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib

KEPT_FROM_THE_NODE = {"torch", "torchvision"}


def expanded(requirements: list[str], extras: dict[str, list[str]], project: str) -> list[str]:
    """The requirements with the project's own extras (``bnexp[plot,slurm]`` in ``dev``) replaced by
    what those extras list: pip cannot find ``bnexp`` itself in a folder of wheels."""
    found = []
    for requirement in requirements:
        name, _, rest = requirement.partition("[")
        if name.strip().lower() == project:
            chosen = rest.split("]", 1)[0].split(",")
            found += expanded([r for extra in chosen for r in extras[extra.strip()]], extras, project)
        else:
            found.append(requirement.split("#")[0].strip())
    return found


def main() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = expanded([*project["dependencies"], *extras["dev"]], extras, project["name"])
    for requirement in dict.fromkeys(wanted):
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        if name.lower() not in KEPT_FROM_THE_NODE:
            sys.stdout.write(requirement + "\n")


if __name__ == "__main__":
    main()
