"""The wheel ships every subpackage, the config tree and the published numbers."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "bnexp").rglob("__init__.py")}
    assert found | {"bnexp.configs"} == set(setuptools["packages"])
    assert setuptools["package-dir"] == {"bnexp.configs": "configs"}
    assert set(setuptools["package-data"]["bnexp.configs"]) >= {"*.yaml", "**/*.yaml"}
    assert (ROOT / "configs" / "__init__.py").is_file()


def test_reference_numbers_are_the_shared_copies() -> None:
    shared = ROOT.parent / "shared" / "reference"  # the checkout sits beside the project's shared folder
    for name in ("published_results.csv", "bnp_best_learning_rates.csv"):
        assert (ROOT / "bnexp" / "reference" / name).read_text() == (shared / name).read_text()
