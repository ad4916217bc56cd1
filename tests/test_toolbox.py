"""bnexp next to the researcher's other tools: CLI conventions, shell completion, sweepers
(Optuna), optional extras, provenance, packaging."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest
from omegaconf import MISSING, OmegaConf

import bnexp
from bnexp.app.compose import config_dir
from bnexp.app.jobs import result_value
from bnexp.cli import COMMANDS, main
from bnexp.engine.callbacks import Callback, TrainState, stop_status
from bnexp.engine.preemption import Preempted
from bnexp.engine.trainer import train
from bnexp.support.errors import EXIT_PREEMPTED
from tests.conftest import TINY, compose_cfg, read_summary, run_cli
from tests.test_resilience import CrashAt

ROOT = Path(__file__).resolve().parents[1]


def test_version_names_bnexp_torch_and_the_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--version", "-V"):
        code, out = run_cli([flag], capsys)
        assert code == 0 and out.startswith(f"bnexp {bnexp.__version__} (") and "torch " in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli([command, "--help"], capsys)
    assert code == 0, out
    assert (f"usage: bnexp {command}" in out) if command != "train" else ("== Config groups (group=option) ==" in out)
    assert not re.search(r":\w+:`|``", out), out  # no reStructuredText from the docstrings


def test_train_help_lists_the_groups_a_command_line_chooses(capsys: pytest.CaptureFixture[str]) -> None:
    """Not those only presets and train.yaml choose (protocol, norm_defaults_layer, sweep)."""
    code, out = run_cli(["train", "--help"], capsys)
    assert code == 0, out
    block = out.split("== Config groups (group=option) ==")[1].split("== Config (")[0]
    listed = dict(line.split(": ", 1) for line in block.strip().splitlines())
    groups = {p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert set(listed) == groups - {"hydra", "protocol", "norm_defaults_layer", "sweep"}
    assert listed["norm"].split(", ") == sorted(p.stem for p in (config_dir() / "norm").glob("*.yaml"))
    assert "cbn/table1" in listed["experiment"].split(", ")


def test_shell_completion_answers_for_bnexp_train(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    code, script = run_cli(["train", "-sc", "install=bash"], capsys)
    assert code == 0 and "complete -o nospace -o default -F hydra_bash_completion bnexp" in script
    monkeypatch.setenv("COMP_LINE", "bnexp tr")
    assert run_cli(["-sc", "query=bash"], capsys) == (0, "train\n")
    monkeypatch.setenv("COMP_LINE", "bnexp train norm=cb")
    code, out = run_cli(["-sc", "query=bash"], capsys)
    assert code == 0 and out.split() == ["norm=cbn"]


def test_fish_completion_as_the_readme_installs_it(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """README: ``bnexp train -sc install=fish | source``; fish then asks ``bnexp -sc query=fish``
    with the line typed so far, one candidate a line."""
    code, script = run_cli(["train", "-sc", "install=fish"], capsys)
    assert code == 0 and "complete -c bnexp -x -a '(hydra_fish_completion)'" in script, script
    monkeypatch.setenv("COMP_LINE", "bnexp tr")
    assert run_cli(["-sc", "query=fish"], capsys) == (0, "train\n")
    monkeypatch.setenv("COMP_LINE", "bnexp train norm=cb")
    code, out = run_cli(["-sc", "query=fish"], capsys)
    assert code == 0 and out.split() == ["norm=cbn"], out


# Lines a TAB press completes: a group's options, every group and key, nested groups, keys under
# a node, a value (hydra.job.name: the task's module), a deletion, a key after a group's choice.
COMPLETED_LINES = ("norm=cb", "", "hydra/launcher=", "hydra/", "optim.", "hydra.job.name=", "trainer.seed=", "~lo",
                   "norm=cbn norm.r", "norm=cbn act=", "-m optim.lr=0.1,0.2 model=res", "+norm=c", "norm=zz",
                   "experiment=", "experiment=cbn/", "norm=[a,b] act=s", "hydra.run.dir=x act=s", "act=s ")
UNANSWERED = ("norm=zz", "experiment=", "experiment=cbn/")  # Hydra has nothing to offer


def test_a_completion_query_answers_as_the_whole_train_command(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``bnexp -sc query=bash`` runs bnexp train's Hydra app without the command line's checks,
    sweeper and launchers (bnexp.app.train.answer_completion, a TAB press waits on it): the
    answers of the whole ``bnexp train -sc query=bash``, line by line."""
    from bnexp.app.train import train_command

    for line in COMPLETED_LINES:
        monkeypatch.setenv("COMP_LINE", f"bnexp train {line}")
        code, answer = run_cli(["-sc", "query=bash"], capsys)
        monkeypatch.setenv("COMP_LINE", f"bnexp {line}")  # as bnexp/cli.py hands the line to bnexp train
        train_command(["-sc", "query=bash"])
        assert code == 0 and answer == capsys.readouterr().out, (line, answer)
        assert bool(answer.split()) == (line not in UNANSWERED), (line, answer)


def test_a_groups_options_are_completed_as_hydra_completes_them(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``bnexp train <group>=<start><TAB>`` is answered without Hydra (group_choices): for every
    group folder of the config tree, with nothing typed after ``=`` and with each option's first
    letter, the answer of the whole ``bnexp train -sc query=bash`` (a group of subfolders only,
    experiment, is left to Hydra); lines it does not answer (a key, a new word, a hydra group,
    other words that are not plain overrides) go to Hydra."""
    from bnexp.app.config_tree import group_choices, group_configs
    from bnexp.app.train import train_command

    groups = sorted(p.name for p in config_dir().iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__"))
    for group in groups:
        options = group_configs(config_dir() / group)
        for start in {"", *(o[:1] for o in options)}:
            line = f"{group}={start}"
            monkeypatch.setenv("COMP_LINE", f"bnexp {line}")
            train_command(["-sc", "query=bash"])
            hydra = capsys.readouterr().out.strip()
            assert group_choices(line) == (hydra if options else None), (line, hydra)
    for line in ("norm.r", "norm=cbn ", "hydra/launcher=", "norm=[a,b] act=s", "hydra.run.dir=x act=s", "-cn x act=s"):
        assert group_choices(line) is None, line
    monkeypatch.setenv("BNEXP_PLUGINS", "somewhere")
    assert group_choices("norm=cb") is None


def key_words(node: dict | list, path: str) -> Iterator[tuple[str, bool]]:
    """Keys being typed under the config node ``node`` (a plain container) at ``path``, each
    with whether key_matches answers it: the node's own (``path.``), each key's first letter, a
    key no node has and one under it; each value's own and one under it (Hydra prints the
    value, or fails); then the same for each node below (but under a key with a dot)."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    listed = not (isinstance(node, list) and any(isinstance(v, str) and "${" in v for v in node))
    if path:  # a list's key is a number: another is refused, one past its end not there
        absent = len(node) if isinstance(node, list) else "nokey"
        yield from ((f"{path}.", listed), (f"{path}.zz", listed), (f"{path}.{absent}.", True),
                    (f"{path}.{absent}.x", True), (f"{path}.nokey.", isinstance(node, dict)))
    for key, value in items:
        where = f"{path}.{key}" if path else str(key)
        if path:
            yield f"{path}.{str(key)[:1]}", listed
        if "." in str(key):  # a sweep's key (trainer.seed): a word names no such node
            continue
        if isinstance(value, (dict, list)):
            yield from key_words(value, where)
        else:
            yield from ((f"{where}.", False), (f"{where}.x", False))


@pytest.mark.parametrize("words", [[], ["model=vgg16", "norm=cbn", "trainer.max_steps=3"],
                                   ["-m", "norm=bn,cbn", "experiment=cbn/table1"], ["model=nosuchmodel"]])
def test_a_keys_completion_matches_hydras_on_every_node_of_the_config(words: list[str]) -> None:
    """key_matches on the plain config that completion_config composes gives Hydra's own
    matches (``CompletionPlugin._get_matches`` on the config its completion composes, what its
    bash completion prints for a word with a dot) for every config node of it with a ``.``
    typed, the first letter of each key under it, keys it does not have, and values; it
    answers every word but those whose answer is a value (Hydra resolves it, prints it or
    fails), which are left to Hydra. A config Hydra cannot compose lists no keys."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException
    from hydra.plugins.completion_plugin import CompletionPlugin
    from hydra.types import RunMode

    from bnexp.app.compose import completion_config, hydra_session
    from bnexp.app.config_tree import key_matches

    plain = completion_config(words)
    assert plain is not None
    multirun = words[:1] == ["-m"]
    try:
        with hydra_session():
            cfg = GlobalHydra.instance().config_loader().load_configuration(
                "train", words[1:] if multirun else words, RunMode.MULTIRUN if multirun else RunMode.RUN)
    except ConfigCompositionException:
        assert plain == {} and key_matches(plain, "norm.") == [] and words == ["model=nosuchmodel"]
        return
    checked = 0
    for word, answered in key_words(plain, ""):
        try:
            hydra: list[str] | None = sorted(set(CompletionPlugin._get_matches(cfg, word)))
        except Exception:  # Hydra fails: an AssertionError for a value's key, an interpolation it cannot resolve
            hydra = None
        ours = key_matches(plain, word)
        assert (ours is not None) == answered, (word, ours, hydra)
        assert ours is None or sorted(set(ours)) == hydra, (word, ours, hydra)
        checked += ours is not None
    assert checked > 200 and {"norm", "trainer", "hydra", "probes"} <= set(plain), (checked, list(plain))


@dataclasses.dataclass
class Inner:
    x: int = 1


@dataclasses.dataclass
class Outer:
    none: Optional[Inner] = None
    missing: Inner = MISSING


def test_a_keys_completion_matches_hydras_on_a_config_of_every_kind_of_node() -> None:
    """As above, on a config with what bnexp's has not: missing list items (Hydra lists them
    whatever the word), interpolations in a list (resolved by Hydra: left to it), lists of
    lists, empty nodes, number keys holding values. A config node that is None or missing, a
    node under a number key, a key that is a boolean (its container would show them otherwise
    than completion sees them), a path: no plain config."""
    from hydra.plugins.completion_plugin import CompletionPlugin

    from bnexp.app.compose import plain_config
    from bnexp.app.config_tree import key_matches

    cfg = OmegaConf.create({"a": {"l": [1, "???", {"x": 1}, [2, [3]], None], "m": "???", "i": "${a.l}", "n": None,
                                  "d": {}, "e": [], "k": {1: "one", 20: "twenty"}},
                            "li": ["${a.m}", 1], "s": "${a}"})
    plain = plain_config(cfg)
    assert plain is not None
    words = list(key_words(plain, ""))
    for word, answered in words:
        ours = key_matches(plain, word)
        assert (ours is not None) == answered, (word, ours)
        assert ours is None or sorted(set(ours)) == sorted(set(CompletionPlugin._get_matches(cfg, word))), (word, ours)
    assert key_matches(plain, "a.l.9") == ["a.l.1="] and len(words) > 40
    assert plain_config(OmegaConf.create({"n": OmegaConf.structured(Inner)})) == {"n": {"x": 1}}
    for odd in ({"k": {1: {"x": 1}}}, {"k": {True: 1}}, {"p": Path("a")}):
        assert plain_config(OmegaConf.create(odd)) is None, odd
    for kept in ("none", "missing"):
        cfg = OmegaConf.structured(Outer)
        cfg[kept] = Inner()  # the other one stays None or missing
        assert plain_config(cfg) is None, kept


# Keys being typed, after other overrides: Hydra's answer, from the cache and from a composition.
KEY_LINES = ("norm.r", "norm.", "trainer.max_", "optim.", "hydra.run.", "hydra.job.c", "schedule.milestones.",
             "model=vgg16 norm=cbn norm.", "-m norm=bn,cbn hydra.sweeper.", "norm.nokey.x", "norm.rho.",
             "experiment=cbn/table1 hydra.sweeper.sweeps.0.", "model=nosuchmodel norm.",
             "trainer.max_steps=7 norm.r", "norm=cbn norm.rho=2 optim.lr=0.05 norm.", "norm.nokey=3 norm.",
             "norm.rho=1,2 norm.", "-m norm.rho=1,2 norm.", "schedule.milestones=3 schedule.")  # a list made a value
# no such key; a config Hydra cannot compose; a key set that is not there; a sweep without -m
EMPTY_KEY_LINES = ("norm.nokey.x", "model=nosuchmodel norm.", "norm.nokey=3 norm.", "norm.rho=1,2 norm.")


def test_a_key_is_completed_as_hydra_completes_it_cold_and_warm(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """``bnexp train <key with a dot><TAB>`` (key_choices): the answer of the whole ``bnexp
    train -sc query=bash`` both with an empty cache folder (composed, then kept) and from the
    cache (nothing composed); a line whose answer is a value (``norm.rho.``) goes to Hydra."""
    import bnexp.app.compose
    from bnexp.app.config_tree import key_choices
    from bnexp.app.train import train_command
    from bnexp.support.cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    compose, answers = bnexp.app.compose.completion_config, {}
    for line in KEY_LINES:
        monkeypatch.setenv("COMP_LINE", f"bnexp {line}")  # as bnexp/cli.py hands the line to bnexp train
        train_command(["-sc", "query=bash"])
        hydra = answers[line] = capsys.readouterr().out
        monkeypatch.setenv("COMP_LINE", f"bnexp train {line}")
        assert run_cli(["-sc", "query=bash"], capsys) == (0, hydra), line  # cold: composed
        monkeypatch.setattr(bnexp.app.compose, "completion_config", lambda words: pytest.fail(f"composed {words}"))
        monkeypatch.setenv("COMP_LINE", f"bnexp train {line}")  # a line Hydra answers is handed on changed
        assert run_cli(["-sc", "query=bash"], capsys) == (0, hydra), line  # warm: from the cache
        monkeypatch.setattr(bnexp.app.compose, "completion_config", compose)
    # one for each set of other words but the values a config holds (trainer.max_steps=7, and norm.rho=2
    # optim.lr=0.05 after norm=cbn): 5 + norm=cbn, norm.nokey=3, the two sweeps and schedule.milestones=3
    assert len(list((tmp_path / "completion").glob("*.json"))) == 10
    line = "norm=cbn trainer.max_steps=9 optim.momentum=0.5 norm.r"  # values never typed before
    monkeypatch.setenv("COMP_LINE", f"bnexp {line}")
    train_command(["-sc", "query=bash"])
    hydra = capsys.readouterr().out
    monkeypatch.setattr(bnexp.app.compose, "completion_config", lambda words: pytest.fail(f"composed {words}"))
    monkeypatch.setenv("COMP_LINE", f"bnexp train {line}")
    assert run_cli(["-sc", "query=bash"], capsys) == (0, hydra) and hydra.split()  # the config of norm=cbn answers
    monkeypatch.setattr(bnexp.app.compose, "completion_config", compose)
    assert key_choices("norm.rho.", compose) is None  # Hydra prints the value: Hydra answers
    assert answers["norm.r"] == "norm.rho=\n" and all(answers[line] == "\n" for line in EMPTY_KEY_LINES)
    assert all(answers[line].split() for line in KEY_LINES if line not in EMPTY_KEY_LINES), answers


def test_a_missing_extra_is_named(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, out = run_cli(["plot", "cbn/table1"], capsys)
    assert code == 2 and "pip install 'bnexp[plot]'" in out


def test_result_value_is_a_float_for_every_outcome() -> None:
    assert result_value("completed", {"final_top1": 91.5}) == 91.5
    assert result_value("skipped", {"status": "completed", "final_top1": 88.0}) == 88.0
    for status, summary in [("diverged", {"final_top1": 10.0}), ("failed", {}), ("skipped", {"status": "diverged"}),
                            ("preempted", {"final_top1": 50.0})]:
        assert math.isnan(result_value(status, summary))


def test_a_skipped_run_returns_its_stored_top1(tmp_path: Path, capsys) -> None:
    from omegaconf import OmegaConf

    from bnexp.app.jobs import run_job

    assert run_cli(["train", *TINY, f"hydra.run.dir={tmp_path / 'run'}"], capsys)[0] == 0
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())["final_top1"]
    hydra_cfg = OmegaConf.create({"overrides": {"task": TINY}})
    assert run_job(compose_cfg(TINY), hydra_cfg, tmp_path / "run", sweeping=True) == ("skipped", stored)


def test_optuna_search_runs_three_trials(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "search"
    code, out = run_cli(["train", "-m", "hparams_search=optuna", "norm=cbn", *TINY, "hydra.sweeper.n_trials=3",
                         f"hydra.sweep.dir={root}"], capsys)
    assert code == 0, out
    summaries = [json.loads(p.read_text()) for p in root.glob("*/summary.json")]
    assert len(summaries) == 3 and len({s["config"]["optim"]["lr"] for s in summaries}) == 3
    assert all(0.25 <= s["config"]["norm"]["rho"] <= 4.0 and 0.001 <= s["config"]["optim"]["lr"] <= 1.0
               for s in summaries)
    results = (root / "optimization_results.yaml").read_text()
    best = max(s["final_top1"] for s in summaries)
    assert f"best_value: {best}" in results and "3 completed" in out


def source_from(folder: Path) -> dict:
    """:func:`bnexp.support.runinfo.source_of_bnexp` of the bnexp package copied under ``folder``."""
    code = "import json; from bnexp.support.runinfo import source_of_bnexp; print(json.dumps(source_of_bnexp()))"
    env = {**os.environ, "PYTHONPATH": str(folder)}
    out = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=folder, check=True,
                   capture_output=True)


def test_provenance_is_bnexp_s_own_checkout_never_the_caller_s(tmp_path: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__")
    checkout = tmp_path / "checkout"  # a clone of bnexp: its commit, and whether it was edited
    shutil.copytree(ROOT / "bnexp", checkout / "bnexp", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", checkout)
    git(checkout, "init", "-q")
    git(checkout, "add", "-A")
    git(checkout, "commit", "-qm", "x")
    clean = source_from(checkout)
    assert len(clean["git_commit"]) == 40 and clean["git_dirty"] is False
    (checkout / "bnexp" / "support" / "options.py").write_text((checkout / "bnexp" / "support" / "options.py").read_text() + "\n")
    assert source_from(checkout)["git_dirty"] is True
    project = tmp_path / "project"  # the user's repository, with bnexp inside it (vendored, a venv)
    shutil.copytree(ROOT / "bnexp", project / "lib" / "bnexp", ignore=ignore)
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "x")
    assert source_from(project / "lib") == {"bnexp_version": bnexp.__version__, "git_commit": None, "git_dirty": None}


def test_packaging_metadata() -> None:
    from importlib.metadata import metadata

    meta = metadata("bnexp")  # the installed distribution's, built from pyproject.toml
    assert (ROOT / "LICENSE").is_file() and (ROOT / "bnexp" / "py.typed").is_file()
    assert {"plot", "slurm", "tensorboard", "mlflow", "wandb", "optuna", "export", "dev"} <= set(
        meta.get_all("Provides-Extra"))
    assert not any(r.startswith("omegaconf") for r in meta.get_all("Requires-Dist"))  # hydra-core brings it
    assert "Typing :: Typed" in meta.get_all("Classifier") and meta.get_all("Project-URL")
    assert meta["License-Expression"] == "MIT"


def test_main_without_arguments_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    main([])
    assert "usage: bnexp <command>" in capsys.readouterr().out


@pytest.mark.parametrize("norm", ["cbn", "bnp", "brn"])
def test_checkpoints_load_with_weights_only(norm: str, tmp_path: Path, capsys) -> None:
    """torch.load's default since 2.6: plain tensors and containers only (RNG states included)."""
    import torch

    extra = ["optim.lr=0.1"] if norm == "bnp" else []
    args = ["train", *TINY, f"norm={norm}", "schedule.warmup=1", "schedule.unit=step", *extra,
            f"hydra.run.dir={tmp_path}"]
    assert run_cli(args, capsys)[0] == 0
    payload = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert payload["step"] == 4 and isinstance(payload["rng"][0]["numpy"]["keys"], torch.Tensor)


def test_init_from_takes_weights_only(tmp_path: Path, capsys) -> None:
    import torch

    assert run_cli(["train", *TINY, f"hydra.run.dir={tmp_path / 'source'}"], capsys)[0] == 0
    source = torch.load(tmp_path / "source" / "checkpoint.pt", weights_only=True)["model"]
    args = ["train", *TINY, "trainer.max_steps=1", "optim.lr=1e-9", "optim.weight_decay=0", "optim.momentum=0",
            f"trainer.init_from={tmp_path / 'source'}", f"hydra.run.dir={tmp_path / 'tuned'}"]
    assert run_cli(args, capsys)[0] == 0
    tuned = torch.load(tmp_path / "tuned" / "checkpoint.pt", weights_only=True)
    assert tuned["step"] == 1  # a new run: its own step, optimizer and schedule
    weights = [k for k in source if k.endswith("op.weight")]
    assert weights and all(torch.allclose(tuned["model"][k], source[k], atol=1e-6) for k in weights)
    code, out = run_cli(["train", *TINY, "model.width=8", f"trainer.init_from={tmp_path / 'source'}",
                         f"hydra.run.dir={tmp_path / 'wide'}"], capsys)
    assert code != 0 and "its weights do not fit this model" in out
    code, out = run_cli(["train", *TINY, f"trainer.init_from={tmp_path / 'nothing'}"], capsys)
    assert code == 2 and "trainer.init_from=" in out


def test_eval_of_a_finished_run(tmp_path: Path, capsys) -> None:
    run = tmp_path / "norm=bn,act=relu"  # a directory named the way bnexp names them
    assert run_cli(["train", *TINY, f'hydra.run.dir="{run}"'], capsys)[0] == 0
    final = json.loads((run / "summary.json").read_text())
    code, out = run_cli(["eval", str(run)], capsys)
    assert code == 0, out
    entries = json.loads((run / "eval.json").read_text())
    own = entries["synthetic/test"]
    assert own["test_acc"] == final["final_top1"] and abs(own["test_loss"] - final["final_test_loss"]) < 1e-5
    assert own["images"] == 32 and own["step"] == 4
    code, out = run_cli(["eval", str(run), "data=digits", "data.image_size=8", "split=train"], capsys)
    assert code == 0, out
    other = json.loads((run / "eval.json").read_text())
    assert set(other) == {"synthetic/test", "digits(data.image_size=8)/train"} and other[
        "digits(data.image_size=8)/train"]["images"] == 1437
    code, out = run_cli(["eval", str(run), "split=val"], capsys)
    assert code == 2 and "split" in out and "test" in out
    code, out = run_cli(["eval", str(tmp_path)], capsys)
    assert code == 2 and "not a finished run" in out
    for bad in ("batch=x", "device=gpu"):
        code, out = run_cli(["eval", str(run), bad], capsys)
        assert code == 2 and bad.split("=")[1] in out


PRESET_LIKE = {"Method": ["BN", "Improv.", "CBN_x"], "Sigmoid": ["91.20 ± 0.31 (10)", "", "– (0; 2 diverged)"],
               "Sigmoid paper": ["90.1", "+0.5%", "n/a"], "Sigmoid Δ": ["+1.10", "", ""],
               "ReLU": ["92.0 (1)", "", "n/a"], "ReLU paper": ["91.9", "", ""], "ReLU Δ": ["+0.10", "", ""]}


def test_latex_export_is_booktabs_with_grouped_columns_and_ascii_only() -> None:
    """What pdflatex needs (no TeX on CI machines to compile it: the structure is checked)."""
    import pandas as pd

    from bnexp.report.table import LEGEND, latex

    text = latex(pd.DataFrame(PRESET_LIKE), f"CBN Table 1 (results/cbn_table1). {LEGEND}.")
    assert text.isascii() and text.count("{") == text.count("}")
    lines = text.splitlines()
    assert lines[0] == r"\begin{table}" and r"\begin{tabular}{lcccccc}" in lines
    assert [r"\toprule", r"\midrule", r"\bottomrule"] == [ln for ln in lines if ln in (r"\toprule", r"\midrule",
                                                                                       r"\bottomrule")]
    header = lines[lines.index(r"\toprule") + 1: lines.index(r"\midrule")]
    assert header[0] == r" & \multicolumn{3}{c}{Sigmoid} & \multicolumn{3}{c}{ReLU} \\"
    assert header[1] == r"\cmidrule(lr){2-4} \cmidrule(lr){5-7}"
    assert header[2] == r"Method & ours & paper & $\Delta$ & ours & paper & $\Delta$ \\"
    body = lines[lines.index(r"\midrule") + 1: lines.index(r"\bottomrule")]
    assert all(row.count(" & ") == 6 and row.endswith(r"\\") for row in body)
    assert r"91.20 $\pm$ 0.31 (10)" in text and r"+0.5\%" in text and r"CBN\_x" in text and "-- (0; 2 diverged)" in text
    assert r"cbn\_table1" in text and r"$\Delta$: ours minus paper" in text


def test_html_page_is_self_contained(tmp_path: Path, capsys, monkeypatch) -> None:
    import pandas as pd

    from bnexp.report.table import LEGEND, html_page

    page = html_page(pd.DataFrame(PRESET_LIKE), "CBN <Table 1>", b"\x89PNG fake", LEGEND)
    assert page.startswith("<!DOCTYPE html>") and "CBN &lt;Table 1&gt;" in page
    assert 'src="data:image/png;base64,iVBORyBmYWtl"' in page and "http" not in page
    assert 'colspan="3"' in page and "91.20 ± 0.31 (10)" in page
    root = tmp_path / "sweep"
    code, out = run_cli(["train", "-m", *TINY, "trainer.seed=0,1", f"hydra.sweep.dir={root}"], capsys)
    assert code == 0, out
    code, out = run_cli(["table", str(root), "format=html", f"out={tmp_path / 'page.html'}"], capsys)
    assert code == 0 and out.strip() == str(tmp_path / "page.html")
    written = (tmp_path / "page.html").read_text()
    assert "data:image/png;base64," in written and "(2)" in written
    import bnexp.report

    monkeypatch.delitem(sys.modules, "bnexp.report.plot", raising=False)
    monkeypatch.delattr(bnexp.report, "plot", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, out = run_cli(["table", str(root), "format=html", f"out={tmp_path / 'other.html'}"], capsys)
    assert code == 2 and "pip install 'bnexp[plot]'" in out and "Traceback" not in out, out


@pytest.mark.parametrize("model,act,size", [("resnet18", "relu", 8), ("efficientnet_b0", "swish", 32)])
def test_export_to_torchvision_gives_the_same_logits(model: str, act: str, size: int, tmp_path: Path, capsys) -> None:
    import torch
    import torchvision

    from bnexp.models import DataSpec, build_model

    run = tmp_path / "run"
    args = ["train", *TINY, f"model={model}", f"act={act}", "norm=bn", f"data.image_size={size}", "trainer.max_steps=2",
            "trainer.batch_size=4", "optim.lr=0.001", f"hydra.run.dir={run}"]
    assert run_cli([a for a in args if a != "model.width=4"], capsys)[0] == 0
    code, out = run_cli(["export", str(run)], capsys)
    assert code == 0 and out.strip() == str(run / f"torchvision_{model}.pt")
    theirs = getattr(torchvision.models, model)(num_classes=10)
    theirs.load_state_dict(torch.load(out.strip(), weights_only=True), strict=True)
    cfg = compose_cfg([a for a in args[1:] if not a.startswith("hydra.") and a != "model.width=4"])
    ours = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, size))
    ours.load_state_dict(torch.load(run / "checkpoint.pt", weights_only=True)["model"])
    x = torch.randn(3, 3, size, size)
    logits = ours.eval()(x)
    assert torch.isfinite(logits).all() and (theirs.eval()(x) - logits).abs().max() < 1e-5


def test_export_to_safetensors_rebuilds_any_run(tmp_path: Path, capsys) -> None:
    import torch

    from bnexp.models import DataSpec, build_model
    from bnexp.report.export import rebuild

    run = tmp_path / "norm=cbn"
    assert run_cli(["train", *TINY, "norm=cbn", f'hydra.run.dir="{run}"'], capsys)[0] == 0
    code, out = run_cli(["export", str(run), "format=torchvision"], capsys)
    assert code == 2 and "format=torchvision needs a torchvision architecture" in out and "norm=cbn" in out
    code, out = run_cli(["export", str(run)], capsys)  # the default where torchvision has no twin
    assert code == 0 and Path(out.strip()) == run / "model.safetensors"
    rebuilt = rebuild(run / "model.safetensors")
    cfg = compose_cfg([*TINY, "norm=cbn"])
    ours = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 8))
    ours.load_state_dict(torch.load(run / "checkpoint.pt", weights_only=True)["model"])
    x = torch.randn(4, 3, 8, 8)
    assert torch.equal(rebuilt(x), ours.eval()(x))
    assert run_cli(["export", str(run), "format=onnx"], capsys)[0] == 2


TRACKED = [*TINY, "norm=bn", "probes=[grad_norm]", "trainer.eval_every=2", "trainer.eval_unit=step"]


def test_tensorboard_gets_hparams_probes_and_weights(tmp_path: Path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "sweep" / "cell"
    assert run_cli(["train", *TRACKED, "logger=tensorboard", f"hydra.run.dir={run}"], capsys)[0] == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"metrics/test_acc", "metrics/train_loss", "metrics/lr"} <= tags
    assert any(t.startswith("probes/grad_norm/") for t in tags) and any(t.startswith("weights/") for t in tags)
    assert [e.step for e in events.Scalars("metrics/test_acc")] == [2, 4]
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = events.PluginTagToContent("hparams")  # the HParams tab: the config and the final metrics
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert session.session_start_info.hparams["optim.lr"].number_value == 0.1
    assert session.session_start_info.hparams["status"].string_value == "completed"


def test_mlflow_logs_into_its_sqlite_store(tmp_path: Path, capsys) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    root = tmp_path / "sweep"
    code, out = run_cli(["train", "-m", *TRACKED, "trainer.seed=0,1", "logger=mlflow", f"logger.tracking_uri={uri}",
                         f"hydra.sweep.dir={root}"], capsys)
    assert code == 0, out
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(root.name)  # the sweep folder groups the seeds
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:
        summary = json.loads((Path(r.data.tags["run_dir"]) / "summary.json").read_text())
        assert r.data.params["optim.lr"] == "0.1" and r.data.params["trainer.seed"] == str(summary["config"]["trainer"]["seed"])
        history = client.get_metric_history(r.info.run_id, "metrics/test_acc")
        assert [m.step for m in history] == [2, 4] and history[-1].value == summary["final_top1"]
        assert any(k.startswith("probes/grad_norm/") for k in r.data.metrics) and r.data.tags["status"] == "completed"
        assert {a.path for a in client.list_artifacts(r.info.run_id)} == {"config.json", "bnexp_summary.json"}


def wandb_records(run_dir: Path, session: int = 0) -> list:
    """The records of an offline W&B run's .wandb file (W&B's leveldb-style log format);
    ``session``: which process's file, in the order they were written (a resumed run has two)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    path = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))[session]
    data, pos, block, records, chunk = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_logs_offline(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "sweep" / "cell"
    assert run_cli(["train", *TRACKED, "logger=wandb", f"hydra.run.dir={run}"], capsys)[0] == 0
    records = wandb_records(run)
    (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (info.run_group, info.display_name, info.project) == ("sweep", "cell", "bnexp")
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    final = json.loads((run / "summary.json").read_text())["final_top1"]
    assert [h["metrics/test_acc"] for h in history if "metrics/test_acc" in h][-1] == final
    assert any(k.startswith("weights/") for h in history for k in h)
    assert any(k.startswith("probes/grad_norm/") for h in history for k in h)
    summary = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for r in records
               if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert summary["status"] == "completed" and summary["final_top1"] == final


class SignalAt(Callback):
    """Send this process ``signum`` after a given step, as a cluster's scheduler would."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def after_step(self, state: TrainState) -> None:
        if state.step == self.step:
            os.kill(os.getpid(), self.signum)


# Checkpoints every 2 steps, evaluations at 4, 8, 12; grad_norm rows at steps 0..11, grad_var
# (measured between steps, and on the final weights) and the clock's epoch rows besides.
RESUMABLE = [*TRACKED, "probes=[grad_norm,grad_var,time]", "trainer.eval_every=4", "trainer.checkpoint_every=2",
             "trainer.checkpoint_unit=step", "trainer.max_steps=12"]


def mlflow_runs(uri: str, experiment: str) -> tuple[list, dict[str, list[int]]]:
    """The runs of an MLflow experiment, and the logged steps of each metric of the first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return runs, {k: [m.step for m in client.get_metric_history(runs[0].info.run_id, k)] for k in runs[0].data.metrics}


def grad_norm_steps(steps: dict[str, list[int]]) -> list[int]:
    return next(v for k, v in steps.items() if k.startswith("probes/grad_norm/"))


def test_preempted_run_closes_and_resumes_its_tracker_run(tmp_path: Path, monkeypatch) -> None:
    """SIGTERM: the MLflow run ends KILLED and the W&B run with exit code 75; the re-run
    continues the same tracker run, and no metric gets a step twice."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for logger in ("mlflow", "wandb"):
        cfg = compose_cfg([*RESUMABLE, f"logger={logger}", f"logger.tracking_uri={uri}" if logger == "mlflow" else
                           "logger.project=bnexp"])
        run = tmp_path / "sweep" / logger
        with pytest.raises(Preempted):
            train(cfg, run, [SignalAt(6, signal.SIGTERM)])
        if logger == "mlflow":
            runs, steps = mlflow_runs(uri, "sweep")
            assert [(r.info.status, r.data.tags["status"]) for r in runs] == [("KILLED", "preempted")]
            assert steps["metrics/test_acc"] == [4] and grad_norm_steps(steps) == list(range(6))  # up to the stop
        time.sleep(1.0)  # W&B names an offline session's folder by the second it started
        train(cfg, run)
        assert read_summary(run)["resumed_from"].endswith("step-000000006.pt")
    runs, steps = mlflow_runs(uri, "sweep")
    assert [r.info.status for r in runs] == ["FINISHED"] and steps["metrics/test_acc"] == [4, 8, 12]
    assert grad_norm_steps(steps) == list(range(12))
    assert any(k.startswith("probes/grad_var/") for k in steps) and any(k.startswith("probes/time/") for k in steps)
    assert {k: v for k, v in steps.items() if len(set(v)) < len(v)} == {}
    first, second = wandb_records(tmp_path / "sweep" / "wandb", 0), wandb_records(tmp_path / "sweep" / "wandb", 1)
    ids = [[r.run.run_id for r in records if r.WhichOneof("record_type") == "run"] for records in (first, second)]
    assert ids[0] == ids[1] and len(ids[0]) == 1
    assert [r.exit.exit_code for r in first if r.WhichOneof("record_type") == "exit"] == [EXIT_PREEMPTED]
    history = [[r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
               for records in (first, second)]
    assert max(history[0]) < min(history[1])  # the re-run sends only what came after the checkpoint


def test_run_resumed_at_its_last_step_finishes_its_tracker_run(tmp_path: Path) -> None:
    """SIGTERM during the last step: the re-run trains no step, and still reopens the MLflow
    run to finish it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose_cfg([*RESUMABLE, "probes=[grad_norm]", "logger=mlflow", f"logger.tracking_uri={uri}"])
    with pytest.raises(Preempted):
        train(cfg, tmp_path / "sweep" / "run", [SignalAt(12, signal.SIGTERM)])
    assert [r.info.status for r in mlflow_runs(uri, "sweep")[0]] == ["KILLED"]
    assert train(cfg, tmp_path / "sweep" / "run")["status"] == "completed"
    runs, steps = mlflow_runs(uri, "sweep")
    assert [(r.info.status, r.data.tags["status"]) for r in runs] == [("FINISHED", "completed")]
    assert steps["metrics/test_acc"] == [4, 8, 12] and grad_norm_steps(steps) == list(range(12))


def test_crashed_run_fails_its_tracker_run_and_resume_continues_it(tmp_path: Path) -> None:
    """An error at step 5, after the checkpoint at 3 and the evaluation at 4: the MLflow run
    ends FAILED and the re-run continues it. What was sent after the checkpoint (accuracy at
    step 4, grad_norm's rows 3 and 4) is sent again: MLflow holds both copies; TensorBoard hides the
    first copies from step 4 on, so row 3 shows twice there; its HParams are the re-run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for logger in ("mlflow", "tensorboard"):
        cfg = compose_cfg([*TRACKED, "trainer.eval_every=4", "trainer.checkpoint_every=3", "trainer.checkpoint_unit=step",
                           "trainer.max_steps=12", f"logger={logger}", *([f"logger.tracking_uri={uri}"] * (logger == "mlflow"))])
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(cfg, tmp_path / "sweep" / logger, [CrashAt(5)])
        if logger == "mlflow":
            runs, _ = mlflow_runs(uri, "sweep")
            assert [(r.info.status, r.data.tags["status"]) for r in runs] == [("FAILED", "failed")]
        train(cfg, tmp_path / "sweep" / logger)
    runs, steps = mlflow_runs(uri, "sweep")
    assert [r.info.status for r in runs] == ["FINISHED"] and steps["metrics/test_acc"] == [4, 4, 8, 12]
    assert grad_norm_steps(steps) == [*range(5), *range(3, 12)]
    events = EventAccumulator(str(tmp_path / "sweep" / "tensorboard" / "tensorboard"))
    events.Reload()
    probe_tag = next(t for t in events.Tags()["scalars"] if t.startswith("probes/grad_norm/"))
    assert [e.step for e in events.Scalars("metrics/test_acc")] == [4, 8, 12]
    assert [e.step for e in events.Scalars(probe_tag)] == [*range(4), *range(3, 12)]
    session = plugin_data_pb2.HParamsPluginData.FromString(events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    assert session.session_start_info.hparams["status"].string_value == "completed"


def test_mlflow_resume_of_a_run_the_store_lacks_starts_a_new_one(tmp_path: Path, caplog) -> None:
    from bnexp.engine.loggers import MLflowLogger

    tracker = MLflowLogger({"name": "mlflow", "tracking_uri": f"sqlite:///{tmp_path / 'other.db'}"})
    run_id = tracker.open(tmp_path / "run", "run", "sweep", {"optim": {"lr": 0.1}}, "0123abcd", 4)
    assert run_id != "0123abcd" and tracker.client.get_run(run_id).data.params == {"optim.lr": "0.1"}
    assert "MLflow run 0123abcd, named in the checkpoint, is not in" in caplog.text


def test_a_failing_tracker_costs_its_tracking_not_the_run(tmp_path: Path, monkeypatch, caplog) -> None:
    from bnexp.engine.loggers import MLflowLogger

    def unreachable(self, values, step) -> None:
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(MLflowLogger, "log", unreachable)
    cfg = compose_cfg([*RESUMABLE, "logger=mlflow", f"logger.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    summary = train(cfg, tmp_path / "sweep" / "run")
    assert summary["status"] == "completed" and (tmp_path / "sweep" / "run" / "checkpoint.pt").is_file()
    assert "logger=mlflow: logging failed (ConnectionError: tracking server unreachable); the run goes on" in caplog.text
    assert caplog.text.count("the run goes on without the tracker") == 1  # tracking ends at the first failure


def test_stop_status_names_how_the_run_stopped() -> None:
    assert [stop_status(e) for e in (Preempted(signal.SIGTERM), Preempted(signal.SIGINT), KeyboardInterrupt(),
                                      RuntimeError("x"))] == ["preempted", "interrupted", "interrupted", "failed"]


def test_a_missing_tracker_names_its_extra(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: importing it raises ImportError
    code, out = run_cli(["train", *TINY, "logger=mlflow", f"hydra.run.dir={tmp_path}"], capsys)
    assert code != 0 and "pip install 'bnexp[mlflow]'" in out


def test_export_refuses_weights_torchvision_would_compute_otherwise(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    args = ["train", *[a for a in TINY if a != "model.width=4"], "model=resnet18", "norm=bn", "norm.eps=0.1",
            "trainer.max_steps=1", "trainer.batch_size=4", "optim.lr=0.001", f"hydra.run.dir={run}"]
    assert run_cli(args, capsys)[0] == 0
    code, out = run_cli(["export", str(run), "format=torchvision"], capsys)
    assert code == 2 and "computes other logits" in out


def test_table_html_without_runs_is_a_page(tmp_path: Path, capsys) -> None:
    code, out = run_cli(["table", "cbn/table1", f"results={tmp_path}", "format=html", f"out={tmp_path / 't.html'}"],
                        capsys)
    assert code == 0 and "<table" in (tmp_path / "t.html").read_text()


def test_completion_install_without_train_and_a_missing_sweeper(capsys, monkeypatch) -> None:
    code, script = run_cli(["-sc", "install=bash"], capsys)
    assert code == 0 and "hydra_bash_completion" in script
    monkeypatch.setenv("COMP_LINE", "bnexp t")
    assert run_cli(["-sc", "query=fish"], capsys)[1].split("\n")[:2] == ["train", "table"]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hydra_plugins.hydra_optuna_sweeper" else real(name, *a))
    code, out = run_cli(["train", "-m", "hparams_search=optuna", *TINY], capsys)
    assert code == 2 and "pip install 'bnexp[optuna]'" in out


def tex_with_booktabs() -> bool:
    """pdflatex and booktabs.sty are installed (``make tex``; CI installs them)."""
    return shutil.which("pdflatex") is not None and shutil.which("kpsewhich") is not None and \
        subprocess.run(["kpsewhich", "booktabs.sty"], capture_output=True).returncode == 0


@pytest.mark.skipif(not tex_with_booktabs(), reason="no pdflatex with booktabs here: `make tex` installs them")
def test_latex_export_compiles_with_pdflatex(tmp_path: Path, capsys) -> None:
    """Every preset's table (no runs yet: the paper's numbers and the missing cells) and one
    with every symbol the cells hold compile without a LaTeX error."""
    import pandas as pd

    from bnexp.report.presets import preset_names
    from bnexp.report.table import LEGEND, latex

    tables = [latex(pd.DataFrame(PRESET_LIKE), f"CBN Table 1. {LEGEND}.")]
    (tmp_path / "empty").mkdir()
    for name in preset_names():
        code, out = run_cli(["table", name, f"results={tmp_path / 'empty'}", "format=latex"], capsys)
        assert code == 0 and out.startswith("\\begin{table}"), name
        tables.append(out)
    (tmp_path / "t.tex").write_text("\\documentclass{article}\\usepackage{booktabs}\\begin{document}\n"
                                    + "\\clearpage\n".join(tables) + "\\end{document}\n")
    done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "t.tex"], cwd=tmp_path,
                          capture_output=True, text=True)
    errors = [line for line in done.stdout.splitlines() if line.startswith("!")]
    assert done.returncode == 0 and not errors and (tmp_path / "t.pdf").is_file(), errors or done.stdout[-2000:]
