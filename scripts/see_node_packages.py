"""Let a venv see the packages of the interpreter that made it: ``python3 scripts/see_node_packages.py VENV``.

``python -m venv --system-site-packages`` exposes the *base* interpreter's site-packages.
On GPU images whose ``python3`` is itself a venv (PyTorch installed in it, not in the base
Python), the new venv would not see that PyTorch. This script writes a ``.pth`` file into
VENV naming the site-packages folders of the interpreter running it; Python adds each line
of a ``.pth`` file to ``sys.path``, after the venv's own folder, so the venv's packages
still win. Where that interpreter is a plain system Python the lines repeat what
``--system-site-packages`` already gives, and change nothing.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "bnexp-node-packages.pth"


def own_site_folders() -> list[str]:
    """The purelib and platlib folders of this interpreter, once each."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def venv_site_folder(venv: Path) -> Path:
    """The purelib folder of the venv's own interpreter."""
    python = venv / "bin" / "python"
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def main(venv: str) -> None:
    target = venv_site_folder(Path(venv)) / PTH_NAME
    target.write_text("".join(f"{folder}\n" for folder in own_site_folders()))
    print(f"{target}: the venv also sees {', '.join(own_site_folders())}")


if __name__ == "__main__":
    main(sys.argv[1])
