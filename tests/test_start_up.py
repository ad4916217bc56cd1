"""Commands that answer at once: what they import (not how long they take: docs/benchmarks.md,
``bnexp bench cli``), the cache of a preset's job configs, and the benchmark's results folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bnexp.bench.cli import fake_runs
from bnexp.report import presets
from bnexp.support.cache import CACHE_ENV
from tests.conftest import run_cli

# Each command as the README writes it, run in one fresh interpreter: whether torch and Hydra
# were imported once it has answered (a table needs Hydra to compose its preset; completing a
# group's options does not, completing a key does).
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
                          text=True, timeout=600)
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
    assert json.loads(cached.read_text()) == composed
    cached.write_text(json.dumps([{"from": "the cache"}] * len(jobs)))
    assert presets.job_configs("popnorm/table2", "quick", jobs) == [{"from": "the cache"}] * len(jobs)
    cached.write_text("[{")  # damaged: composed again, and written back
    assert presets.job_configs("popnorm/table2", "quick", jobs) == composed == json.loads(cached.read_text())
    monkeypatch.setenv(CACHE_ENV, str(cached / "x"))  # inside a file: no cache folder can be made there
    assert presets.job_configs("popnorm/table2", "quick", jobs) == composed

    key = presets.cache_key("popnorm/table2", "quick", jobs)
    tree = tmp_path / "configs"
    shutil.copytree(presets.config_dir(), tree)
    monkeypatch.setattr(presets, "config_dir", lambda: tree)
    assert presets.cache_key("popnorm/table2", "quick", jobs) == key  # the same files
    norm = tree / "norm" / "popnorm.yaml"
    norm.write_text(norm.read_text() + "\n")
    assert presets.cache_key("popnorm/table2", "quick", jobs) != key
    assert presets.cache_key("popnorm/table2", "quick", jobs[:1]) != presets.cache_key("popnorm/table2", "quick", jobs)


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
                                            "complete 'bnexp train norm=cb'", "complete 'bnexp train norm.r'",
                                            "bnexp table popnorm/table2 (cached job configs and rows)"]
    assert all(r["seconds_median"] > 0 and r["ratio"] == r["seconds_median"] / float(r["baseline"].split()[1])
               for r in records)
