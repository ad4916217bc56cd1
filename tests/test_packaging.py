"""The wheel ships every subpackage, the config tree and the published numbers."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Mapping

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("bnexp", "hydra_plugins")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found | {"bnexp.configs"} == set(setuptools["packages"])
    assert not (ROOT / "hydra_plugins" / "__init__.py").exists()  # a namespace shared with Hydra's launchers
    assert setuptools["package-dir"] == {"bnexp.configs": "configs"}
    assert set(setuptools["package-data"]["bnexp.configs"]) >= {"*.yaml", "**/*.yaml"}
    assert (ROOT / "configs" / "__init__.py").is_file()


def test_published_numbers_have_their_schema_and_known_values() -> None:
    """The package's copy of the published numbers: its columns, value ranges, and cells
    checked by hand against the papers (CBN Table 1, POP-Norm Table 2, BNP Tables 1-3)."""
    from bnexp.reference import bnp_learning_rates, published

    frame = published()
    assert list(frame.columns) == ["paper", "table", "dataset", "model", "activation", "row", "method", "metric",
                                   "mean", "std", "runs", "note"]
    assert set(frame["paper"]) == {"cbn", "popnorm", "bnp"}
    assert set(frame["metric"]) == {"top1", "top5", "seconds_per_epoch"}
    assert frame["mean"].notna().all() and (frame["std"].dropna() >= 0).all()
    # the run counts the papers state: ten trials wherever a spread is printed, one where a table says one run
    assert (frame.loc[frame["std"].notna(), "runs"] == 10).all()
    assert (frame.loc[frame["note"].str.contains("single run"), "runs"] == 1).all()
    accuracy = frame[frame["metric"] != "seconds_per_epoch"]
    assert accuracy["mean"].between(0, 100).all()
    assert not frame.duplicated(["paper", "table", "dataset", "model", "activation", "row", "method", "metric"]).any()

    def cell(**keys: str) -> tuple[float, float]:
        rows = frame
        for key, value in keys.items():
            rows = rows[rows[key] == value]
        assert len(rows) == 1, keys
        return float(rows["mean"].iloc[0]), float(rows["std"].iloc[0])

    assert cell(paper="cbn", table="1", activation="sigmoid", row="1") == (78.97, 0.53)
    assert cell(paper="cbn", table="1", activation="relu", row="2") == (91.98, 0.06)
    assert cell(paper="popnorm", table="1", dataset="cifar10", model="resnet20", activation="sigmoid",
                method="popnorm")[0] == 89.68
    lrs = bnp_learning_rates()
    assert lrs[("mlp3x100", "cifar10", 1, "bnp")] == 0.1 and lrs[("mlp3x100", "cifar10", 1, "bn")] is None
    assert lrs[("cnn5", "cifar10", 2, "brn")] == 0.01 and len(lrs) == 62


# The layers of docs/architecture.md, lowest first; a module may import its own layer and
# those below it. Lazy imports inside functions count too.
LAYERS = [
    ("bnexp.support", "bnexp.reference", "bnexp.__init__"),
    ("bnexp.nn",),
    ("bnexp.models",),
    ("bnexp.data",),
    ("bnexp.engine", "bnexp.probes"),
    ("bnexp.app", "hydra_plugins"),
    ("bnexp.report", "bnexp.bench"),
    ("bnexp.studies",),
    ("bnexp.cli", "bnexp.__main__"),
]


def layer_of(module: str) -> int:
    matches = [(len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer of docs/architecture.md"
    return max(matches)[1]


def package_modules() -> dict[str, Path]:
    """Every module of bnexp and hydra_plugins by dotted name (a package by its ``__init__``)."""
    modules = {}
    for top in ("bnexp", "hydra_plugins"):
        for path in sorted((ROOT / top).rglob("*.py")):
            modules[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The bnexp and hydra_plugins modules ``path`` imports, at the top or in a function;
    ``from package import name`` counts as importing the module ``package.name`` if it is one."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
    return {name for name in found if name.startswith(("bnexp.", "hydra_plugins."))}


def test_imports_point_one_way() -> None:
    """support -> nn -> models -> data -> engine -> app -> report -> studies -> cli: no module
    imports a higher layer."""
    modules = package_modules()
    for module, path in modules.items():
        for name in imports_of(path, modules):
            assert layer_of(name) <= layer_of(module if module != "bnexp" else "bnexp.__init__"), \
                f"{module} imports {name}, a higher layer"


def test_no_two_modules_import_each_other() -> None:
    """Not even lazily: a module pair that needs each other is one module, or a third holds
    what both need."""
    modules = package_modules()
    edges = {(module, name) for module, path in modules.items() for name in imports_of(path, modules)}
    pairs = sorted({tuple(sorted(e)) for e in edges if e[0] != e[1] and (e[1], e[0]) in edges})
    assert not pairs, f"modules that import each other: {pairs}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str = "dev") -> set[str]:
    """The distributions pyproject.toml names for ``pip install bnexp[extra]``: the core
    dependencies, the extra's and those of the bnexp extras it names (not what they pull in)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names, todo = set(), [*project["dependencies"], *extras[extra]]
    while todo:
        requirement = todo.pop()
        name = canonical(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])
        if name == "bnexp":
            todo += [r for e in re.search(r"\[(.*)\]", requirement).group(1).split(",") for r in extras[e]]
        else:
            names.add(name)
    return names


# Distributions the tests import that come as part of a declared one's own interface.
PART_OF = {"omegaconf": "hydra-core", "pyyaml": "hydra-core", "pillow": "torchvision"}


def test_every_module_the_tests_import_is_declared() -> None:
    """A third-party module a test imports comes from a distribution that the dev extra
    declares itself, or one of PART_OF (mpmath came only through torch's sympy before)."""
    providers = importlib.metadata.packages_distributions()
    local = {"bnexp", "tests", "hydra_plugins"}
    assert set(PART_OF.values()) <= declared()
    missing = {}
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in sys.stdlib_module_names or top in local or top == "__future__":
                    continue
                if not {canonical(d) for d in providers.get(top, [top])} & (declared() | set(PART_OF)):
                    missing[top] = path.name
    assert not missing, missing
