"""Shared test helpers: composing configs and running the CLI in-process."""

from __future__ import annotations

import os

# Tests use tiny tensors: one thread avoids oversubscribing a 2-core machine (subprocesses
# started by the tests inherit the variable).
os.environ["OMP_NUM_THREADS"] = "1"

import copy
import csv
import functools
import json
import pickle
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from _pytest.nodeid import NodeId
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from bnexp.app.compose import config_dir, prepare_config_tree
from bnexp.cli import main
from bnexp.support.cache import CACHE_ENV

torch.set_num_threads(1)

# Overrides that shrink any run to a few seconds on a CPU.
TINY = [
    "data=synthetic",
    "data.image_size=8",
    "data.train_size=64",
    "data.test_size=32",
    "model.width=4",
    "trainer.batch_size=16",
    "trainer.max_steps=4",
    "trainer.device=cpu",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` first, each module's in their order: pytest-xdist hands out tests
    in this order, so the long ones start early instead of leaving one worker busy at the end
    while the other idles. (xdist groups go first anyway: --dist loadgroup sends the units
    holding the most tests first.)"""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        for item in items:
            name_group(item)


def name_group(item: pytest.Item) -> None:
    """Suffix ``@group`` to the id of a test marked ``xdist_group``, as pytest-xdist does to
    send a group's tests to one worker. xdist 3.8 sets ``item._nodeid``, which pytest 9 no
    longer reads: without this the groups are ignored (the SLURM tests then overlap on the
    one-node cluster, and a module fixture is made once per worker)."""
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    suffix = f"@{'_'.join(names)}"
    if names and not item.nodeid.endswith(suffix):
        item._id = NodeId.parse(item.nodeid + suffix)  # parse keeps the string as it is


@pytest.fixture(scope="session", autouse=True)
def bnexp_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """bnexp's cache folder in the test run's temporary folder, one for both workers (and the
    commands the tests start): ``bnexp table``, ``plot``, the two-stage tuning and the recorded
    fingerprints match runs to a preset by composing the config of each of its jobs (CBN
    Table 1: 1350 of them), which :func:`bnexp.report.presets.job_configs` keeps there; the
    first test to ask composes them, under the cache's lock, the others read them. Nothing is
    written to the user's own cache."""
    base = tmp_path_factory.getbasetemp()  # an xdist worker's is a subfolder of the run's
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bnexp_cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(folder))
        yield


# `bnexp reproduce popnorm/table2 scale=quick` on the CPU, as several tests begin: its runs made
# once (the tests that use it share an xdist group), each test working on its own copy.
QUICK_PRESET = ["reproduce", "popnorm/table2", "scale=quick", "trainer.device=cpu"]


@pytest.fixture(scope="session")
def quick_preset_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sweep folder QUICK_PRESET fills (4 runs); copy it with :func:`copy_runs` before use."""
    root = tmp_path_factory.mktemp("quick_preset") / "sweep"
    main([*QUICK_PRESET, f"hydra.sweep.dir={root}"])
    return root


def copy_runs(runs: Path, to: Path) -> Path:
    shutil.copytree(runs, to)
    return to


def compose_cfg(overrides: list[str]) -> DictConfig:
    """The config ``bnexp train`` would run with these overrides (a copy: tests may change it).
    A Hydra compose takes 0.15-0.5 s and a third of the tests' calls repeat an earlier one, so
    each process composes a list of overrides once: configs/ does not change during the tests."""
    return copy.deepcopy(composed(tuple(overrides)))


@functools.cache
def composed(overrides: tuple[str, ...]) -> DictConfig:
    prepare_config_tree()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run ``bnexp`` in this process; return (exit code, stdout+stderr)."""
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


def run_dir_of(tmp_path: Path) -> list[str]:
    """Hydra overrides that put a single run's outputs in ``tmp_path/run``."""
    return [f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]


def read_metrics(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def read_summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def write_cifar10(root: Path, per_batch: int = 20, test: int = 20, seed: int = 0) -> Path:
    """A tiny CIFAR-10 folder in the real python-pickle format torchvision reads."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)

    def dump(name: str, n: int) -> None:
        entry = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, n).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)

    for i in range(1, 6):
        dump(f"data_batch_{i}", per_batch)
    dump("test_batch", test)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return folder
