"""The config schema: every value checked before anything is written, fingerprints unchanged.

Each case is named in docs/resilience.md's fault table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest

from bnexp.app.cmdline import group_options
from bnexp.engine.config import resolved, validate
from bnexp.engine.identity import fingerprint
from bnexp.engine.schema import TrainKeys, without_null
from tests.conftest import TINY, compose_cfg, run_cli

# (overrides, what the one line must name). Each was accepted, or refused by torch mid-run
# with exit code 1, after the run's folder, lock and train.log were made.
BAD_VALUES = [
    # accepted without a word
    ("data.augment=no", "data.augment='no' is not valid: data.augment must be true or false"),
    ("schedule.warmup=-1", "schedule.warmup=-1 is not valid: schedule.warmup must be a number >= 0"),
    ("norm.momentum=2", "norm.momentum=2 is not valid: norm.momentum must be a number in [0, 1]"),
    ("norm.momentum=-0.5", "norm.momentum=-0.5 is not valid"),
    ("data.noise=nan", "data.noise=nan is not valid: data.noise must be a number >= 0"),
    ("norm.rho=nan", "norm.rho=nan is not valid: norm.rho must be a number > 0"),
    ("norm.name=cbn", "norm.name=cbn does not match norm=bn"),
    # refused by torch once the run had started
    ("trainer.seed=4294967296", "trainer.seed=4294967296 is not valid: trainer.seed must be an integer in [0, 4294967295]"),
    ("data.seed=18446744073709551616", "data.seed=18446744073709551616 is not valid"),
    ("model.width=4294967296", "model.width=4294967296 is not valid: model.width must be an integer in [1, 65536]"),
    ("model.width=9223372036854775808", "model.width=9223372036854775808 is not valid"),
    ("norm.eps=0", "norm.eps=0 is not valid: norm.eps must be a number > 0"),
    ("norm.eps=-1e-5", "norm.eps=-1e-05 is not valid"),
    ("optim.nesterov=true optim.momentum=0", "optim.nesterov=true needs optim.momentum > 0"),
    ("schedule.warmup=1 schedule.warmup_factor=-0.1", "schedule.warmup_factor=-0.1 is not valid: "
                                                      "schedule.warmup_factor must be a number in [0, 1]"),
    ("data.padding=-1", "data.padding=-1 is not valid: data.padding must be an integer >= 0"),
    ("data.eval_batch_size=0", "data.eval_batch_size=0 is not valid: data.eval_batch_size must be an integer >= 1"),
    ("data.num_workers=-1", "data.num_workers=-1 is not valid: data.num_workers must be an integer >= 0"),
    # a page of OmegaConf's traceback
    ("optim.lr=${nope.nope}", "optim.lr=${nope.nope} cannot be resolved: Interpolation key 'nope.nope' not found"),
    ("hydra.run.dir=${nope.nope}", "hydra.run.dir cannot be resolved: Interpolation key 'nope.nope' not found"),
    ("hydra.run.dir=${hydra.run.dir}", "hydra.run.dir cannot be resolved"),
    ("optim.lr=${optim.lr}", "optim.lr=${optim.lr} cannot be resolved: Recursive interpolation detected"),
]


def assert_refused_before_writing(code: int, out: str, expected: str, folder: Path) -> None:
    """Exit code 2, one line naming the value, and no file or folder made."""
    assert code == 2, out
    assert out.startswith("bnexp: error: ") and out.count("\n") == 1 and expected in out, out
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize(("overrides", "expected"), BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_value_is_one_line_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str], overrides: str,
                                                          expected: str) -> None:
    monkeypatch.chdir(tmp_path)  # the default run directory: results/runs/<overrides>
    code, out = run_cli(["train", *TINY, "norm=bn", *overrides.split()], capsys)
    assert_refused_before_writing(code, out, expected, tmp_path)


# A bad value anywhere in a sweep stops the whole sweep before its first cell.
BAD_SWEEPS = [
    ("optim.lr=0.1,-1", "optim.lr=-1 is not valid: optim.lr must be a number > 0"),
    ("data.augment=true,no", "data.augment='no' is not valid"),
    ("trainer.seed=0,4294967296", "trainer.seed=4294967296 is not valid"),
    ("norm=bn,cbn norm.momentum=2", "norm.momentum=2 is not valid"),
    ("norm=bn,cbn norm.name=bn", "norm.name=bn does not match norm=cbn"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_SWEEPS, ids=[o for o, _ in BAD_SWEEPS])
def test_bad_value_in_a_sweep_stops_it_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str], overrides: str,
                                                                   expected: str) -> None:
    monkeypatch.chdir(tmp_path)  # the default sweep folder: results/multirun/<overrides>
    code, out = run_cli(["train", "-m", *TINY, *overrides.split()], capsys)
    assert_refused_before_writing(code, out, expected, tmp_path)


def test_bad_group_option_in_a_preset_sweep_stops_it_before_its_first_cell(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep written in a config (here given as hydra.sweeper.sweeps) is checked by the
    sweeper, one job per combination of group options: act=nope stops it before act=relu runs."""
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", "-m", *TINY, "hydra.sweeper.sweeps=[{act: 'relu,nope'}]"], capsys)
    assert code != 0 and "Could not find 'act/nope'" in out and "2 not run" in out, out
    assert not [p for p in tmp_path.rglob("*") if p.name in ("summary.json", "metrics.csv", "checkpoint.pt")]


# Fingerprints computed by bnexp before the schema existed (commit de8aea6): checking values
# must not change the config a run trains with. Three were recomputed after issue 25's review
# changed those configs on purpose (BN warmup cell of bnp/resnet110, TF defaults of bnp/cnn5,
# bn_4things keeping its biases); tests/test_recorded_fingerprints.py holds them against the
# code before issue 25. Three more after issue 38 changed those presets on purpose: POP-Norm's
# CIFAR batches shuffled per epoch, BNP's CNN5 inputs in [0, 1], the grad_var probe of CBN Fig. 10
# (before: fa3f2708daf3dfed, 659214730e053c8e, edb8255dab3cff54).
FINGERPRINTS = [
    ([], "a0c16885890638d7"),
    (TINY, "bf4214f7a903018c"),
    (["norm=cbn", "act=tanh"], "a4783998add6d0be"),
    (["experiment=bnp/resnet110"], "0502d033763c566c"),
    (["experiment=popnorm/table1", "scale=quick"], "a3cc00a069f43d74"),
    (["norm=brn", "model=vgg16", "data=cifar100"], "5aedef35a9d40f8c"),
    (["norm=bnp_gn", "model=resnet18", "data=imagenet"], "d3aaa709815e93c8"),
    (["experiment=bnp/cnn5"], "7f38b879e6aa9465"),
    (["experiment=cbn/amat", "scale=quick"], "63fc8ab0d55bd663"),
    (["experiment=arora/auto_rate"], "3b001a1a557e6f72"),
    (["norm=bn_4things", "optim=adam"], "9b3e3f7088ddde6b"),
]


@pytest.mark.parametrize(("overrides", "expected"), FINGERPRINTS, ids=[" ".join(o) or "defaults" for o, _ in FINGERPRINTS])
def test_fingerprints_of_valid_configs_are_unchanged(overrides: list[str], expected: str) -> None:
    cfg = compose_cfg(overrides)
    validate(cfg)
    assert fingerprint(cfg) == expected


def untyped(values: Any, kind: Any = TrainKeys, prefix: str = "") -> list[str]:
    """The keys under ``values`` that the schema type ``kind`` does not name."""
    kind = without_null(kind)
    if not isinstance(values, dict):
        return []
    if isinstance(kind, type) and issubclass(kind, dict) and hasattr(kind, "__total__"):  # a TypedDict
        hints = get_type_hints(kind, include_extras=True)
        return [found for key, value in values.items()
                for found in ([f"{prefix}{key}"] if key not in hints else untyped(value, hints[key], f"{prefix}{key}."))]
    if get_origin(kind) is dict:
        return [found for key, value in values.items() for found in untyped(value, get_args(kind)[1], f"{prefix}{key}.")]
    return []


SHIPPED = [f"{group}={option}" for group in ("model", "norm", "act", "data", "optim", "schedule", "trainer", "logger",
                                            "probe", "experiment") for option in group_options(group)]


@pytest.mark.parametrize("choice", SHIPPED)
def test_schema_types_every_key_of_the_shipped_configs(choice: str) -> None:
    """A key added to a config file gets its type in bnexp/engine/schema.py (unnamed keys would pass
    unchecked)."""
    assert untyped(resolved(compose_cfg([choice]))) == []
