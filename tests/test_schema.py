"""The config schema: every value checked before anything is written, fingerprints unchanged.

Each case is named in docs/resilience.md's fault table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import numpy as np
import pytest
import torch

from bnexp.app.config_tree import group_options
from bnexp.engine.config import resolved, validate
from bnexp.engine.identity import fingerprint
from bnexp.engine.optim import build_schedule
from bnexp.engine.schema import TrainKeys, without_null
from bnexp.engine.trainer import CheckpointClock
from bnexp.support.errors import ConfigError
from tests.conftest import TINY, compose_cfg, read_summary, run_cli
from tests.test_data_sets import npz_arrays

# (overrides, what the one line must name). Each was accepted, or refused by torch mid-run
# with exit code 1, after the run's folder, lock and train.log were made.
BAD_VALUES = [
    # accepted without a word
    ("data.augment=no", "data.augment='no' is not valid: data.augment must be true or false"),
    ("schedule.warmup=-1", "schedule.warmup=-1 is not valid: schedule.warmup must be a number in [0, 1000000000]"),
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
    ("data.padding=-1", "data.padding=-1 is not valid: data.padding must be an integer in [0, 1024]"),
    ("data.eval_batch_size=0", "data.eval_batch_size=0 is not valid: data.eval_batch_size must be an integer in [1, 1048576]"),
    ("data.num_workers=-1", "data.num_workers=-1 is not valid: data.num_workers must be an integer in [0, 1024]"),
    # accepted, then failing, hanging or running out of memory mid-run (issue 39): upper bounds, with their reason
    ("trainer.epochs=1e308", "trainer.epochs=1e+308 is not valid: trainer.epochs must be a number in [0, 1000000000] "
                             "(10**9 steps"),
    ("schedule.milestones=[1e308]", "schedule.milestones=[1e+308] is not valid: schedule.milestones must be a list of "
                                    "numbers in [0, 1000000000]"),
    ("schedule.warmup=1e308", "schedule.warmup=1e+308 is not valid"),
    ("trainer.eval_every=1e308", "trainer.eval_every=1e+308 is not valid: trainer.eval_every must be a number in "
                                 "(0, 1000000000]"),
    ("data.image_size=100000", "data.image_size=100000 is not valid: data.image_size must be an integer in [1, 1024] "
                               "(ImageNet's protocols crop 224 pixels"),
    ("data.train_size=1000000000", "data.train_size=1000000000 is not valid: data.train_size must be an integer in "
                                   "[1, 16777216]"),
    ("data.channels=100000", "data.channels=100000 is not valid: data.channels must be an integer in [1, 64]"),
    ("data.num_classes=100000000", "data.num_classes=100000000 is not valid: data.num_classes must be an integer in "
                                   "[1, 131072] (or null)"),
    ("data.padding=100000", "data.padding=100000 is not valid: data.padding must be an integer in [0, 1024]"),
    ("trainer.dist_timeout=1e300", "trainer.dist_timeout=1e+300 is not valid: trainer.dist_timeout must be a number in "
                                   "(0, 604800] (a week outlasts any job's time limit)"),
    ("data.train_size=16000000", "data=synthetic with data.train_size=16000000, data.test_size=32, data.channels=3 and "
                                 "data.image_size=8 holds 3072006144 bytes of images, more than 1073741824"),
    # EfficientNet's multipliers (model.depth_mult=1e5 was still building the model after 4 minutes)
    ("model=efficientnet_b0 model.width_mult=1e5", "model.width_mult=100000.0 is not valid: model.width_mult must be a "
                                                   "number in (0, 8.0] (or null) (EfficientNet-B7, the largest"),
    ("model=efficientnet_b0 model.depth_mult=1e5", "model.depth_mult=100000.0 is not valid"),
    # ended "completed" without a step, or never checkpointed (4 steps per epoch): the smallest valid value
    ("trainer.epochs=0 trainer.max_steps=null", "trainer.epochs=0 is not valid: it rounds to no step; the smallest "
                                                "valid value is 0.25 (epochs of 4 steps: one step)"),
    ("trainer.epochs=1e-9 trainer.max_steps=null", "trainer.epochs=1e-09 is not valid: it rounds to no step"),
    ("trainer.checkpoint_every=0.1 trainer.checkpoint_unit=epoch",
     "trainer.checkpoint_every=0.1 is not valid: it rounds to no step; the smallest valid value is 0.25 (epochs of 4 "
     "steps: one step), or 0 to turn it off"),
    # decayed the lr twice at step 2
    ("schedule.milestones=[2,2]", "schedule.milestones=[2, 2] is not valid: schedule.milestones must be in strictly "
                                  "increasing order"),
    ("schedule.milestones=[1,1.1]", "schedule.milestones=[1, 1.1] is not valid: they fall on the steps [4, 4]"),
    # a number where a path belongs: Hydra reads it as an integer
    ("trainer.init_from=2024", "trainer.init_from=2024 is not valid: trainer.init_from must be a string (or null); "
                               "quote a number meant as a name or path: trainer.init_from='2024'"),
    # a setting removed: 49 lines of traceback, or (~optim.lr) a run folder made, then a failure
    *[(f"~{key}", f"~{key} removes a setting every run reads: give it a value instead ({key}=VALUE)")
      for key in ("trainer.seed", "trainer.resume", "trainer.batch_size", "trainer.nproc", "data.name", "optim.lr")],
    # an option Hydra does not know: its usage page, and an empty run folder left behind
    ("--foo", "unknown option '--foo'; bnexp train takes -m (--multirun), --dry-run (with -m)"),
    # a literal ${...} in the run's folder: Hydra resolved it again (an empty folder left, the run elsewhere)
    ("hydra.run.dir=out/\\${x}", "hydra.run.dir names the folder out/${x}, which holds '${': Hydra would read it as "
                                  "an interpolation again"),
    # the same with the launcher of two processes, which failed before any rank started
    ("trainer.nproc=2 hydra.run.dir=out/\\${x}", "hydra.run.dir names the folder out/${x}, which holds '${'"),
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
    tiny = [o for o in TINY if not (o.startswith("model.") and "model=" in overrides)]  # another model's keys
    code, out = run_cli(["train", *tiny, "norm=bn", *overrides.split()], capsys)
    assert_refused_before_writing(code, out, expected, tmp_path)


# A bad value anywhere in a sweep stops the whole sweep before its first cell.
BAD_SWEEPS = [
    ("optim.lr=0.1,-1", "optim.lr=-1 is not valid: optim.lr must be a number > 0"),
    ("data.augment=true,no", "data.augment='no' is not valid"),
    ("trainer.seed=0,4294967296", "trainer.seed=4294967296 is not valid"),
    ("norm=bn,cbn norm.momentum=2", "norm.momentum=2 is not valid"),
    ("norm=bn,cbn norm.name=bn", "norm.name=bn does not match norm=cbn"),
    # tracebacks: an empty sweep (StopIteration), an interval under bnexp's own sweeper (its message
    # inside Hydra's traceback), a range listed in memory (MemoryError, even with --dry-run)
    ("trainer.seed=range(0)", "trainer.seed=range(0) gives no value: a sweep needs at least one"),
    ("optim.lr=interval(0.1,0.2)", "optim.lr=interval(0.1,0.2): bnexp's sweeper takes value lists and range(); an "
                                   "interval search needs a search sweeper (hydra/sweeper=optuna)"),
    ("trainer.seed=range(0,100000000) --dry-run", "the sweeps trainer.seed=range(0,100000000) make 100000000 jobs, more "
                                                  "than 100000"),
    ("trainer.seed=range(0,1000) optim.lr=range(1,102)", "make 101000 jobs, more than 100000"),
    # the same in a sweep of the sweeper's config (a preset's, or given as here): a traceback, or "0 cells"
    ("hydra.sweeper.sweeps=[{optim.lr:'interval(0.1,0.2)'}]", "optim.lr=interval(0.1,0.2): bnexp's sweeper takes value "
                                                             "lists and range()"),
    ("hydra.sweeper.sweeps=[{trainer.seed:'range(0)'}]", "the sweeps [{'trainer.seed': 'range(0)'}] make no job: each "
                                                        "key of a sweep needs at least one value"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_SWEEPS, ids=[o for o, _ in BAD_SWEEPS])
def test_bad_value_in_a_sweep_stops_it_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str], overrides: str,
                                                                   expected: str) -> None:
    monkeypatch.chdir(tmp_path)  # the default sweep folder: results/multirun/<overrides>
    code, out = run_cli(["train", "-m", *TINY, *overrides.split()], capsys)
    assert_refused_before_writing(code, out, expected, tmp_path)


def test_quoted_values_of_a_command_line_sweep_are_strings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Paths holding '=' or ',' are quoted (README), and a sweep over them was refused
    (``trainer.resume={'text': 'never', ...} is not valid``): each quoted value is its text."""
    monkeypatch.chdir(tmp_path)
    for name in ("a=1.npz", "b,2.npz"):
        np.savez(tmp_path / name, **npz_arrays())
    code, out = run_cli(["train", "-m", "data=npz", 'data.path="a=1.npz","b,2.npz"', "model.width=4", "norm=gn",
                         "trainer.batch_size=4", "trainer.max_steps=2", "trainer.device=cpu"], capsys)
    assert code == 0 and "sweep finished: 2 cells: 2 completed" in out, out
    paths = sorted(read_summary(p.parent)["config"]["data"]["path"] for p in tmp_path.rglob("summary.json"))
    assert paths == ["a=1.npz", "b,2.npz"]


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


def test_an_interval_that_rounds_to_no_step_checkpoints_every_step_not_never() -> None:
    """The clock itself (trainer.checkpoint_every=0.1 epochs at 4 steps an epoch rounded to 0
    steps: no periodic checkpoint ever, so a SIGKILL lost the run); validate refuses the value first."""
    clock = CheckpointClock(0.1, "epoch", steps_per_epoch=4, check_every=1)
    assert [clock.due(step) for step in (1, 2, 3)] == [True, True, True]
    assert not CheckpointClock(0, "epoch", steps_per_epoch=4, check_every=1).due(1)  # 0 turns them off


def test_a_schedule_never_decays_twice_on_one_step() -> None:
    """schedule.milestones=[2,2] (or epochs that round to one step) decayed the lr 0.1 -> 0.001 at step 2."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match=r"schedule.milestones=\[2, 2\] is not valid: they fall on the steps \[2, 2\]"):
        build_schedule(optimizer, {"name": "multistep", "unit": "step", "milestones": [2, 2]}, steps_per_epoch=4)
    with pytest.raises(ConfigError, match=r"they fall on the steps \[4, 4\] \(4 per epoch\)"):
        build_schedule(optimizer, {"name": "multistep", "unit": "epoch", "milestones": [1, 1.1]}, steps_per_epoch=4)


def test_amounts_in_epochs_of_data_read_at_run_time_are_checked_once_it_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An npz file's size is known once it is read: the same one line, exit 2, before any step."""
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "set.npz", **npz_arrays())  # 8 training images: 1 step of 16 an epoch
    code, out = run_cli(["train", "data=npz", "data.path=set.npz", "model.width=4", "trainer.batch_size=8",
                         "trainer.max_steps=4", "trainer.device=cpu", "trainer.checkpoint_every=0.4",
                         "trainer.checkpoint_unit=epoch"], capsys)
    assert code == 2 and out.splitlines()[-1] == ("bnexp: error: trainer.checkpoint_every=0.4 is not valid: it rounds "
                                                  "to no step; the smallest valid value is 1 (epochs of 1 step: one "
                                                  "step), or 0 to turn it off"), out
    assert not list(tmp_path.rglob("step-*.pt"))
