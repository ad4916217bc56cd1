"""``bnexp bench cli``: the wall time of whole ``bnexp`` commands, start-up included.

Times the commands a user expects an answer from at once, each in a fresh process as a
shell starts it: ``bnexp --help``, ``bnexp --version``, the shell-completion queries a TAB
press runs (a command name; a config group's option and a config key of ``bnexp train``),
and ``bnexp table <preset>`` on a results folder holding the preset's whole sweep (CBN
Table 1: 1,350 runs).
That folder is written by :func:`fake_runs`, not by training. Each command runs ``warmup``
untimed times (the table's first call composes its job configs into a fresh cache folder
and keeps there the rows of the runs written more than two seconds before; the key's
completion keeps there the config it lists keys of), then ``reps``
times. ``ratio`` is the median seconds over the command's target
(:data:`TARGETS`): below 1 meets it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from hydra import compose
from omegaconf import OmegaConf

from bnexp.app.compose import hydra_session, is_group, parser
from bnexp.bench.common import Record, device_of, record
from bnexp.engine.identity import cell_name, fingerprint, flatten
from bnexp.report.presets import job_configs, load_preset, preset_overrides
from bnexp.support.cache import CACHE_ENV
from bnexp.support.errors import ConfigError

DEFAULTS: dict[str, Any] = {"reps": 5, "warmup": 1, "device": "cpu", "threads": 0, "preset": "cbn/table1",
                            "results": "", "out": "results/bench/cli.json"}
COLUMNS = ("name", "seconds_median", "seconds_min", "seconds_max", "baseline", "ratio")
# Seconds each command should take at most on a 2-core CPU (issue 40).
TARGETS = {"help": 0.5, "version": 0.5, "complete": 0.5, "table": 1.5}


def commands(preset: str, results: Path) -> dict[str, tuple[list[str], dict[str, str], float]]:
    """Each timed command: its arguments after ``bnexp``, extra environment and target."""
    return {
        "bnexp --help": (["--help"], {}, TARGETS["help"]),
        "bnexp --version": (["--version"], {}, TARGETS["version"]),
        "complete 'bnexp tr'": (["-sc", "query=bash"], {"COMP_LINE": "bnexp tr"}, TARGETS["complete"]),
        "complete 'bnexp train norm=cb'": (["-sc", "query=bash"], {"COMP_LINE": "bnexp train norm=cb"},
                                           TARGETS["complete"]),
        "complete 'bnexp train norm.r' (cached composition)": (["-sc", "query=bash"],
                                                                 {"COMP_LINE": "bnexp train norm.r"}, TARGETS["complete"]),
        f"bnexp table {preset} (cached job configs and rows)": (["table", preset, f"results={results}"], {},
                                                                TARGETS["table"]),
    }


def wall_seconds(args: Sequence[str], env: Mapping[str, str]) -> float:
    """Seconds from starting ``bnexp ARGS`` (as ``python -m bnexp``) to its exit; a
    ConfigError when it fails."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "bnexp", *args], env={**os.environ, **env}, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise ConfigError(f"bnexp {' '.join(args)} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return seconds


def fake_runs(name: str, folder: Path, scale: str = "full") -> int:
    """Write every run of preset ``name``'s sweep under ``folder`` as a finished sweep leaves
    it, without training: per job ``<cell>/summary.json`` (status completed, the config its
    job composes, made-up accuracies and losses), ``.hydra/overrides.yaml``, ``config.yaml``,
    ``metrics.csv`` and ``train.log``. Returns the number of runs."""
    jobs = load_preset(name, scale).jobs
    configs = job_configs(name, scale, jobs)
    bases: dict[tuple[str, ...], dict[str, Any]] = {}
    with hydra_session():
        read = parser()
        for i, (job, config) in enumerate(zip(jobs, configs)):
            groups = tuple(line for line in job if is_group(read.parse_overrides([line])[0]))
            if groups not in bases:  # a summary's settings besides the result config: tags, logger, lookup, ...
                cfg = compose("train", [*preset_overrides(name, scale), *groups])
                bases[groups] = flatten(OmegaConf.to_container(cfg, resolve=True))
            write_run(folder / cell_name(job), job, nested({**bases[groups], **config}), 80.0 + (i % 97) / 10)
    return len(jobs)


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys as a tree: ``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def write_run(run: Path, job: Sequence[str], config: dict[str, Any], top1: float) -> None:
    """One finished run's files, as a sweep's job writes them."""
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(job)))
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    steps = 64_000
    rows = ["step,epoch,lr,train_loss,train_acc,test_loss,test_acc,seconds"]
    rows += [f"{steps * e // 4},{30 * e},0.1,{1.0 / e:.4f},{top1 - 4 + e:.2f},{1.2 / e:.4f},{top1 - 4 + e:.2f},{60 * e}"
             for e in range(1, 5)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    (run / "train.log").write_text("[bnexp] a run written by bnexp bench cli, not trained\n")
    summary = {"status": "completed", "bnexp_version": "bench", "git_commit": None, "git_dirty": None,
               "torch_version": "bench", "fingerprint": fingerprint(config), "config": config, "final_top1": top1,
               "best_top1": top1 + 0.1, "final_top5": top1 + 10, "best_top5": top1 + 10.1, "final_test_loss": 0.3,
               "final_train_loss": 0.01, "steps": steps, "epochs": 120.0, "wall_seconds": 240.0, "data_files": {}}
    (run / "summary.json").write_text(json.dumps(summary))


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(options["results"] or Path(tmp) / "results")
        if not any(results.rglob("summary.json")):  # results=DIR: written there once, then reused
            fake_runs(options["preset"], results)
        env = {CACHE_ENV: str(Path(tmp) / "cache")}
        cases = commands(options["preset"], results)
        for args, extra, _ in cases.values():
            for _ in range(options["warmup"]):
                wall_seconds(args, {**env, **extra})
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(options["reps"]):  # interleaved: a slow spell of a shared machine slows them all
            for name, (args, extra, _) in cases.items():
                times[name].append(wall_seconds(args, {**env, **extra}))
    return [record(name, "whole process", device, times[name], f"target {target:g} s",
                   ratio=statistics.median(times[name]) / target, seconds_min=min(times[name]),
                   seconds_max=max(times[name]))
            for name, (_, _, target) in cases.items()]
