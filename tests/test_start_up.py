"""Commands that answer at once: what they import (not how long they take: docs/benchmarks.md,
``bnexp bench cli``), the cache of a preset's job configs, and the benchmark's results folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from bnexp.app import config_tree
from bnexp.bench.cli import fake_runs
from bnexp.engine.identity import result_fingerprint
from bnexp.report import presets
from bnexp.support.cache import CACHE_ENV
from tests.conftest import run_cli

# Each command as the README writes it, run in one fresh interpreter: whether torch and Hydra
# were imported once it has answered (with an empty cache folder a table needs Hydra to compose
# its preset and a key's completion the config it lists; completing a group's options does not).
IMPORTS = """
import json, os, sys
from bnexp.cli import main
found = []
for args, line in json.loads(sys.argv[1]):
    os.environ["COMP_LINE"] = line
    try:
        main(args)
    except SystemExit as exit_:
        assert not exit_.code, (args, exit_.code)
    found.append([args, line, "torch" in sys.modules, "hydra" in sys.modules])
print(json.dumps(found), file=sys.stderr)
"""


@pytest.mark.slow
def test_help_version_completion_and_table_import_no_torch(tmp_path: Path) -> None:
    fake_runs("popnorm/table2", tmp_path / "results" / "popnorm" / "table2")
    commands = [(["--help"], ""), (["--version"], ""), (["-sc", "query=bash"], "bnexp tr"),
                (["-sc", "query=bash"], "bnexp train norm=cb"), (["train", "-sc", "install=bash"], ""),
                (["-sc", "query=bash"], "bnexp train norm.r"), (["train", "--help"], ""),
                (["table", "popnorm/table2", "format=markdown"], "")]
    done = subprocess.run([sys.executable, "-c", IMPORTS, json.dumps(commands)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stderr.strip().splitlines()[-1])
    assert [(torch, hydra) for _, _, torch, hydra in found] == [(False, False)] * 4 + [(False, True)] * 4, found
    assert "complete -o nospace -o default -F hydra_bash_completion bnexp" in done.stdout
    assert {"norm=cbn", "norm.rho="} <= set(done.stdout.split()) and "80.00 (1)" in done.stdout and "1 failed" not in done.stdout


def test_a_presets_job_configs_come_from_the_cache_until_a_config_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """job_configs composes once and reads the cache after; a cache file that does not hold
    the configs is composed again; a changed config file or an unusable cache folder gives
    the configs as composed."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    jobs = presets.load_preset("popnorm/table2", "quick").jobs
    composed = presets.compose_job_configs("popnorm/table2", "quick", jobs)
    assert presets.job_configs("popnorm/table2", "quick", jobs) == composed
    [cached] = (tmp_path / "cache" / "job_configs").glob("*.json")
    prints = [result_fingerprint(c) for c in composed]
    assert json.loads(cached.read_text()) == composed
    assert presets.job_fingerprints("popnorm/table2", "quick", jobs) == prints
    fingerprints = cached.with_suffix(".fingerprints.json")
    assert json.loads(fingerprints.read_text()) == prints
    assert presets.load_preset("popnorm/table2", "quick").expected == dict(zip(prints, composed))
    cached.write_text(json.dumps([{"from": "the cache"}] * len(jobs)))
    fingerprints.write_text(json.dumps(["f"] * len(jobs)))
    assert presets.job_configs("popnorm/table2", "quick", jobs) == [{"from": "the cache"}] * len(jobs)
    assert presets.job_fingerprints("popnorm/table2", "quick", jobs) == ["f"] * len(jobs)
    for damaged in ("[{", json.dumps({"configs": composed}), json.dumps(composed[:1])):
        cached.write_text(damaged)  # composed again, and written back
        fingerprints.write_text(damaged)
        assert presets.job_fingerprints("popnorm/table2", "quick", jobs) == prints
        assert json.loads(cached.read_text()) == composed and json.loads(fingerprints.read_text()) == prints
    monkeypatch.setenv(CACHE_ENV, str(cached / "x"))  # inside a file: no cache folder can be made there
    assert presets.job_configs("popnorm/table2", "quick", jobs) == composed

    key = presets.cache_key("popnorm/table2", "quick", jobs)
    tree = tmp_path / "configs"
    shutil.copytree(presets.config_dir(), tree)
    monkeypatch.setattr(config_tree, "config_dir", lambda: tree)
    assert presets.cache_key("popnorm/table2", "quick", jobs) == key  # the same files
    norm = tree / "norm" / "popnorm.yaml"
    norm.write_text(norm.read_text() + "\n")
    assert presets.cache_key("popnorm/table2", "quick", jobs) != key
    assert presets.cache_key("popnorm/table2", "quick", jobs[:1]) != presets.cache_key("popnorm/table2", "quick", jobs)


def cold_then_warm(commands: list[tuple[list[str], str]], folder: Path) -> list[str]:
    """What ``commands`` print in a fresh interpreter started twice in ``folder``, after
    checking that none imported torch and that they imported Hydra the first time alone
    (the cache folder empty before it)."""
    answers = []
    for cold in (True, False):
        done = subprocess.run([sys.executable, "-c", IMPORTS, json.dumps(commands)], cwd=folder, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        found = json.loads(done.stderr.strip().splitlines()[-1])
        assert [(torch, hydra) for _, _, torch, hydra in found] == [(False, cold)] * len(commands), (cold, found)
        answers.append(done.stdout)
    return answers


def test_a_key_completed_from_the_cache_imports_neither_torch_nor_hydra(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A completion query of a key composes with Hydra the first time (into an empty cache
    folder) and imports neither torch nor Hydra after, with the same answers."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    commands = [(["-sc", "query=bash"], "bnexp train norm.r"), (["-sc", "query=bash"], "bnexp train model=vgg16 optim.")]
    answers = cold_then_warm(commands, tmp_path)
    assert answers[0] == answers[1] and "norm.rho=" in answers[0].split() and "optim.lr=" in answers[0].split()


@pytest.mark.parametrize("name, scale, overrides", [("cbn/table1", "full", ()), ("bnp/cnn5", "full", ()),
                                                     ("cbn/table1", "quick", ("cbn_row=r1", "trainer.seed=0,1"))])
def test_a_preset_read_back_from_the_cache_is_the_composed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              name: str, scale: str, overrides: tuple[str, ...]) -> None:
    """read_preset composes once and reads the preset back after: the same config (keys in
    their order, number keys, interpolations kept, the values they resolve to: bnp_lr's
    learning rates), sweeps, jobs, layout and folder, and a config that refuses unknown keys
    as the composed one does. A record of another shape, or no cache folder, composes again."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    composed = presets.load_preset(name, scale, overrides)

    def plain(p: presets.Preset) -> tuple:
        unresolved = yaml.safe_dump(OmegaConf.to_container(p.cfg, resolve=False, enum_to_str=True), sort_keys=False)
        resolved = {key: OmegaConf.to_container(p.cfg[key], resolve=True) if OmegaConf.is_config(p.cfg[key])
                    else p.cfg[key] for key in p.cfg if key != "hydra"}
        return (unresolved, resolved, p.sweeps, p.params, p.task, p.overrides, p.jobs, p.layout, p.results_dir, p.seeds)

    assert plain(presets.read_preset(name, scale, overrides)) == plain(composed)
    monkeypatch.setattr(presets, "load_preset", lambda *args: pytest.fail("composed again"))
    kept = presets.read_preset(name, scale, overrides)
    assert plain(kept) == plain(composed)
    with pytest.raises(Exception, match="no_such_key"):
        kept.cfg.trainer.no_such_key
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    [record] = (tmp_path / "cache" / "presets").glob("*.json")
    held = json.loads(record.read_text())
    for damaged in ("{", "[]", json.dumps({**held, "cfg": "[1, 2]"}), json.dumps({**held, "cfg": "a: ["}),
                    json.dumps({**held, "sweeps": [{"act": "relu"}]}), json.dumps({**held, "params": [1]}),
                    json.dumps({**held, "cfg": "a: 1\n"}),  # a mapping without what a preset holds
                    json.dumps({**held, "cfg": "a: " + "[" * 5000 + "]" * 5000}),  # nested past any config
                    json.dumps({**held, "cfg": held["cfg"] + "x: &a [1, 2]\ny: [*a, *a]\n"})):  # aliases
        record.write_text(damaged)
        assert plain(presets.read_preset(name, scale, overrides)) == plain(composed)
        assert json.loads(record.read_text()) == held  # written again
    monkeypatch.setenv(CACHE_ENV, str(record / "x"))  # inside a file: no cache folder
    assert plain(presets.read_preset(name, scale, overrides)) == plain(composed)


def test_a_cache_folder_keeps_its_most_recently_used_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prune keeps the entries whose files were written last (taking an entry's lock writes
    it, so a read counts as a use), deletes every file of the others and leaves files being
    written alone; write_cache prunes after each write, to CACHE_ENTRIES entries."""
    from bnexp.support import cache

    folder = tmp_path / "job_configs"
    folder.mkdir()
    suffixes = (".json", ".lock", ".fingerprints.json")
    for i in range(5):
        for suffix in suffixes:
            (folder / f"k{i}{suffix}").write_text("x")
            os.utime(folder / f"k{i}{suffix}", ns=(i * 10**9, i * 10**9))
    os.utime(folder / "k0.lock", ns=(9 * 10**9, 9 * 10**9))  # k0's lock taken last
    (folder / ".k1.json.tmp").write_text("being written")
    cache.prune(folder, keep=3)
    assert sorted(p.name for p in folder.iterdir()) == sorted([".k1.json.tmp", *(f"k{i}{s}" for i in (0, 3, 4)
                                                                                for s in suffixes)])
    monkeypatch.setattr(cache, "CACHE_ENTRIES", 2)
    cache.write_cache(folder / "new.json", b"{}")
    assert sorted(p.name for p in folder.iterdir()) == sorted([".k1.json.tmp", "new.json", "new.lock",
                                                               *(f"k0{s}" for s in suffixes)])
    cache.prune(tmp_path / "missing")  # no folder: nothing to do


def test_a_preset_that_resolves_with_hydras_own_resolvers_is_composed_each_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table whose folder reads ${now:...}, a resolver Hydra registers, not bnexp, composes
    its preset with Hydra every time instead of failing to resolve the record without it."""
    import datetime

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fake_runs("popnorm/table2", tmp_path / "results" / str(datetime.date.today().year))
    commands = [(["table", "popnorm/table2", "hydra.sweep.dir=results/${now:%Y}", "format=csv"], "")]
    answers = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", IMPORTS, json.dumps(commands)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert [hydra for *_, hydra in json.loads(done.stderr.strip().splitlines()[-1])] == [True]
        answers.append(done.stdout)
    assert answers[0] == answers[1] and "80.00 (1)" in answers[0]


def test_a_table_read_from_the_cache_imports_neither_torch_nor_hydra(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``bnexp table`` composes its preset with Hydra the first time (into an empty cache
    folder) and reads it back after without importing Hydra, printing the same table; so for a
    preset given overrides, a sweep among them."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fake_runs("popnorm/table2", tmp_path / "results" / "popnorm" / "table2")
    commands = [(["table", "popnorm/table2"], ""), (["table", "popnorm/table2", "trainer.seed=0,1", "format=csv"], "")]
    answers = cold_then_warm(commands, tmp_path)
    assert answers[0] == answers[1] and "80.00 (1)" in answers[0] and "80.00 (1 of 2; 1 missing)" in answers[0]


def test_a_keys_config_is_kept_until_what_it_is_composed_from_changes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """key_choices composes the config of a line's other words once and reads it from the
    cache after; a config file of the search path that changes (here a BNEXP_PLUGINS one),
    other words or the mode compose again; a cache file that is not a JSON object, or not a
    regular file, is composed again, and without a cache folder every query composes."""
    from bnexp.app.compose import completion_config
    from bnexp.app.config_tree import key_choices

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    plugin = tmp_path / "toy_keys"
    (plugin / "configs" / "extra").mkdir(parents=True)
    (plugin / "__init__.py").write_text("")
    (plugin / "configs" / "extra" / "a.yaml").write_text("alpha: 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("BNEXP_PLUGINS", "toy_keys")
    composed: list[list[str]] = []

    def compose(words: list[str]) -> dict | None:
        composed.append(words)
        return completion_config(words)

    assert key_choices("+extra=a extra.", compose) == "extra.alpha=" and len(composed) == 1
    assert key_choices("+extra=a extra.al", compose) == "extra.alpha=" and len(composed) == 1  # from the cache
    [kept] = (tmp_path / "cache" / "completion").glob("*.json")
    assert json.loads(kept.read_text())["extra"] == {"alpha": 1}
    (plugin / "configs" / "extra" / "a.yaml").write_text("beta: 1\n")
    assert key_choices("+extra=a extra.", compose) == "extra.beta=" and len(composed) == 2
    assert key_choices("-m +extra=a extra.", compose) == "extra.beta=" and len(composed) == 3
    assert key_choices("norm=cbn norm.r", compose) == "norm.rho=" and len(composed) == 4
    assert len(list(kept.parent.glob("*.json"))) == 4
    (plugin / "configs" / "extra" / "a.yaml").write_text("alpha: 1\n")  # as it was: kept from before
    assert key_choices("+extra=a extra.", compose) == "extra.alpha=" and len(composed) == 4
    for foreign in (b"[1]", b"{", b"\xff", b"null"):
        kept.write_bytes(foreign)
        assert key_choices("+extra=a extra.al", compose) == "extra.alpha=", foreign
        assert json.loads(kept.read_text())["extra"] == {"alpha": 1}  # written again
    kept.unlink()
    os.mkfifo(kept)
    assert key_choices("+extra=a extra.", compose) == "extra.alpha=" and kept.is_file()
    kept.unlink()
    kept.mkdir()
    assert key_choices("+extra=a extra.", compose) == "extra.alpha=" and kept.is_dir()
    count = len(composed)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "toy_keys" / "__init__.py" / "cache"))  # no folder can be made
    assert [key_choices("+extra=a extra.", compose) for _ in range(2)] == ["extra.alpha="] * 2
    assert len(composed) == count + 2
    kept.rmdir()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    kept.write_text(json.dumps({"extra": {"alpha": {}, "b": [1]}, "c": 1}))  # any JSON object: read as a config
    assert [key_choices(f"+extra=a {word}", compose) for word in ("extra.", "extra.b.", "extra.alpha.x", "c.")] \
        == ["extra.alpha. extra.b.", "extra.b.0=", "", None]


def test_the_digest_follows_the_files_of_every_hydra_plugins_folder(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra_plugin_dirs names bnexp's hydra_plugins folder and any other on the import path
    (whose plugins register configs Hydra composes with), so config_digest changes with a file
    there."""
    from bnexp.support.cache import package_dir

    before = config_tree.config_digest("x")
    (tmp_path / "hydra_plugins" / "other_plugin").mkdir(parents=True)
    (tmp_path / "hydra_plugins" / "other_plugin" / "__init__.py").write_text("# a plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = config_tree.hydra_plugin_dirs()
    assert {tmp_path / "hydra_plugins", package_dir().parent / "hydra_plugins"} <= set(found), found
    assert found == sorted(set(found))
    with_plugin = config_tree.config_digest("x")
    assert with_plugin != before
    (tmp_path / "hydra_plugins" / "other_plugin" / "__init__.py").write_text("# another version\n")
    assert config_tree.config_digest("x") not in (before, with_plugin)


def test_the_benchmarks_results_folder_is_the_presets_whole_sweep(tmp_path: Path, capsys) -> None:
    """fake_runs writes every run of the preset's sweep, each as a sweep leaves it: the table
    finds all of them in their cells, and none outside the table."""
    assert fake_runs("popnorm/table2", tmp_path, "quick") == 4
    code, out = run_cli(["table", "popnorm/table2", "scale=quick", f"results={tmp_path}", "format=csv"], capsys)
    assert code == 0 and "not in this table" not in out, out
    assert out.count("(2)") == 4, out  # 2 cells of 2 seeds, top-1 and top-5


@pytest.mark.slow
def test_bench_cli_times_every_command(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli.json"
    code, text = run_cli(["bench", "cli", "preset=popnorm/table2", "reps=1", "warmup=1", f"out={out}"], capsys)
    assert code == 0, text
    records = json.loads(out.read_text())
    assert [r["name"] for r in records] == ["bnexp --help", "bnexp --version", "complete 'bnexp tr'",
                                            "complete 'bnexp train norm=cb'",
                                            "complete 'bnexp train norm.r' (cached composition)",
                                            "bnexp table popnorm/table2 (cached job configs and rows)"]
    assert all(r["seconds_median"] > 0 and r["ratio"] == r["seconds_median"] / float(r["baseline"].split()[1])
               for r in records)
