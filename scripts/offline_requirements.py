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


def main() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    for requirement in wanted:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        if name.lower() not in KEPT_FROM_THE_NODE:
            sys.stdout.write(requirement.split("#")[0].strip() + "\n")


if __name__ == "__main__":
    main()
