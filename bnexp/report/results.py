"""Run outputs into pandas: one row per summary.json, one frame per metrics.csv, the time
probe's seconds per epoch.

Results folders come from other people. A run's file that cannot be used (not the JSON,
YAML or CSV it should be, a value of the wrong type, nesting too deep to parse) is named
in one warning line on stderr, and the command goes on without it: a run whose
summary.json is unusable counts as failed (as a half-written one does); a run whose
``.hydra/overrides.yaml`` is unusable is left out, as it cannot be placed in a cell; an
unusable metrics.csv or probes.csv leaves out that run's curves or probe values.

A copy of a run inside the tree (``cp -r RUN RUN.bak``, an ``old/`` folder) is the same run:
:func:`load_summaries` counts each run once, by what identifies it (:func:`run_identity`), and
says which copy it took. :func:`load_runs` is the documented entry point for scripts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import reprlib
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import pandas as pd
import yaml

from bnexp.app.cells import CELLS
from bnexp.app.cells import listed as cells_listed
from bnexp.engine.identity import flatten, result_config, result_fingerprint, short_hash
from bnexp.report.presets import YAML_LOADER
from bnexp.support.cache import cache_dir, file_state, package_digest, write_cache
from bnexp.support.errors import DataError
from bnexp.support.options import print_warning
from bnexp.support.untrusted import RECORD_FILE, TABLE_FILE, read_regular, read_regular_text, text_stream

REPLICATES = ("trainer.seed",)  # overrides whose runs a cell pools
SUMMARY = "summary.json"
ROWS_FORMAT = 2  # the RowCache file's layout
RESULT = "result_config"  # the column of a run's result config (a mapping), kept as a row is (RowCache)
NAMES = frozenset((SUMMARY, CELLS))  # the files run_dirs looks for
# The summary fields that tables and plots compute with: a number or null in any summary.
NUMERIC_FIELDS = re.compile(r"(final|best)_\w+|steps_per_epoch|num_classes|wall_seconds|epochs|steps|params")


def parsed(path: Path, parse: Callable[[Path], Any], errors: tuple[type[Exception], ...] = (OSError, ValueError)) -> Any:
    """``parse(path)``; a DataError naming the file when it cannot be read or parsed
    (``errors``), or nests deeper than the parser can follow (Python's recursion limit)."""
    try:
        return parse(path)
    except RecursionError:
        raise DataError(f"{path}: nested too deeply to parse") from None
    except errors as err:
        raise DataError(f"{path}: unreadable ({' '.join(str(err).split())})") from None


def run_overrides(run_dir: Path) -> dict[str, str]:
    """The overrides Hydra recorded for a sweep's job (``.hydra/overrides.yaml``), by key; a
    DataError naming the file when it is not a YAML list of strings."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    lines = parsed(path, lambda p: yaml.load(read_regular_text(p, RECORD_FILE), Loader=YAML_LOADER),
                   (OSError, ValueError, yaml.YAMLError)) or []
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise DataError(f"{path}: expected a list of key=value lines, got {reprlib.repr(lines)}")
    return dict(line.split("=", 1) for line in lines if "=" in line)


def read_summary(path: Path) -> dict[str, Any]:
    """A summary.json; a DataError naming it unless it is a JSON object whose ``config`` is
    an object and whose :data:`NUMERIC_FIELDS` are numbers or null."""
    summary = parsed(path, lambda p: json.loads(read_regular_text(p, RECORD_FILE)))
    if not isinstance(summary, dict):
        raise DataError(f"{path}: expected a JSON object, got a {type(summary).__name__}")
    if not isinstance(summary.get("config", {}), dict):
        raise DataError(f"{path}: 'config' is a {type(summary['config']).__name__}, not an object")
    for key, value in summary.items():
        if NUMERIC_FIELDS.fullmatch(key) and value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DataError(f"{path}: {key} is {reprlib.repr(value)}, not a number")
    return summary


def run_identity(summary: Mapping[str, Any]) -> Optional[str]:
    """What makes a run this run, whatever folder holds it: the fingerprint its summary
    recorded, the digests of its data files (not their paths) and any other digest it records
    (the starting weights'); None for a summary that recorded no fingerprint (made by hand or
    by a bnexp too old to record one), which is never taken for a copy of another."""
    recorded = summary.get("fingerprint")
    if not isinstance(recorded, str):
        return None
    digests = sorted(str(v) for k, v in _digest_fields(summary) if k != "config")
    return short_hash(json.dumps([recorded, digests]), 24)


def starting_weights(summary: Mapping[str, Any]) -> Optional[str]:
    """The sha256 of the file a run started from (its ``init_weights`` record), None for a run
    started from scratch."""
    record = summary.get("init_weights")
    entries = record.values() if isinstance(record, Mapping) else ()
    return ",".join(sorted(str(e.get("sha256")) for e in entries if isinstance(e, Mapping))) or None


def warn_pooled_weights(frame: pd.DataFrame, results: Path) -> None:
    """A warning when runs that differ in their seed only started from different weights (the
    file of one ``trainer.init_from`` path replaced between them): a table's cell pools them."""
    if "starting_weights" not in frame:
        return
    started = frame[frame["starting_weights"].notna()]
    groups: dict[str, dict[str, str]] = {}
    for config, weights, run_dir in zip(started["result_config"], started["starting_weights"], started["run_dir"]):
        settings = {k: v for k, v in config.items() if k not in REPLICATES}
        groups.setdefault(json.dumps(settings, sort_keys=True, default=str), {}).setdefault(weights, run_dir)
    mixed = [runs for runs in groups.values() if len(runs) > 1]
    if mixed:
        named = ", ".join(f"{run_dir} (sha256 {weights[:12]}...)" for weights, run_dir in mixed[0].items())
        more = f"; and {len(mixed) - 1} more such settings" if len(mixed) > 1 else ""
        print_warning(f"runs under {results} that differ only in their seed started from different weights "
                      f"under one trainer.init_from path (its file replaced between them), which a table pools: "
                      f"{named}{more}; give new starting weights a file name of their own")


def _digest_fields(node: Any, depth: int = 0) -> list[tuple[str, Any]]:
    """Every ``(key, value)`` under ``node`` whose key names a digest (md5, sha256, digest),
    the run's config left out; a few levels deep (``data_files`` -> path -> md5)."""
    if not isinstance(node, Mapping) or depth > 4:
        return []
    found = []
    for key, value in node.items():
        if key == "config" and depth == 0:
            continue
        if isinstance(value, Mapping):
            found += _digest_fields(value, depth + 1)
        elif any(word in str(key).lower() for word in ("md5", "sha256", "digest")):
            found.append((str(key), value))
    return found


def summary_row(path: Path) -> Optional[dict[str, Any]]:
    """One run: status, metrics, the config flattened to dotted keys (``act.name``), the
    job's overrides as ``overrides.<key>`` (``overrides.cbn_row``: the values its sweep gave),
    and its identity: ``fingerprint`` and ``result_config`` (:mod:`bnexp.engine.identity`). A run
    whose summary cannot be used counts as failed; one whose overrides cannot is None (left
    out); a warning names the file either way."""
    try:
        overrides = {f"overrides.{key}": value for key, value in run_overrides(path.parent).items()}
    except DataError as err:
        print_warning(f"{err}; the run is left out")
        return None
    where = {**overrides, "run_dir": str(path.parent)}
    try:
        summary = read_summary(path)
        where["run_identity"] = run_identity(summary)
        where["starting_weights"] = starting_weights(summary)
        config = summary.pop("config", {})
        flat = flatten(config)
        row = {**flat, **{k: v for k, v in summary.items() if not isinstance(v, (dict, list))}}
        # result_config flattens what it is given after dropping a top-level hydra node: given the
        # flattened config (without one), it gives the same and flattens once less; and the
        # config's fingerprint is its result config's, computed once
        result = result_config(config if "hydra" in config else flat)
        identity = {"result_config": result, "fingerprint": result_fingerprint(result)}
    except RecursionError:  # a config that parsed but nests deeper than flattening it can follow
        return failed_row(DataError(f"{path}: 'config' is nested too deeply"), where)
    except DataError as err:
        return failed_row(err, where)
    return {**row, **where, **identity}


def failed_row(err: DataError, where: dict[str, str]) -> dict[str, Any]:
    """The row of a run whose summary.json cannot be used (failed, with the reason), after a
    warning that names the file."""
    print_warning(f"{err}; the run counts as failed")
    return {**where, "status": "failed", "error": f"unreadable summary: {err}", "fingerprint": None,
            "result_config": {}}


def run_dirs(folder: Path) -> list[Path]:
    """The run directories of a results folder, each once: those under it holding a
    summary.json, then those its sweep folders list (:mod:`bnexp.app.cells`: the cells of an
    ad-hoc sweep train where single runs do) that hold one. One walk of the tree finds both
    as ``Path.rglob`` does: an entry of that name that exists (a link followed to its target),
    also in a folder that can be entered but not listed; links to folders are not walked.
    The walk reads each folder's entries once and asks the file system about links alone."""
    found: dict[str, list[str]] = {SUMMARY: [], CELLS: []}  # folders, as the walk spells them
    folders = [os.fspath(folder)]
    while folders:
        root = folders.pop()
        here, below = [], []
        try:
            with os.scandir(root) as entries:
                for entry in entries:
                    try:
                        exists, walked = not entry.is_symlink() or os.path.exists(entry.path), entry.is_dir(
                            follow_symlinks=False)
                    except OSError:  # a file system that gives no entry types, then no answer
                        exists, walked = os.path.exists(entry.path), False
                    if entry.name in NAMES and exists:
                        here.append(entry.name)
                    if walked:
                        below.append(entry.path)
        except OSError:  # not listed: the names are looked up one by one
            here, below = [name for name in NAMES if os.path.exists(os.path.join(root, name))], []
        for name in here:
            found[name].append(root)
        folders += below
    # in the order of the files' paths as Path compares them: part by part
    inside = [Path(d) for d in sorted(found[SUMMARY], key=lambda d: [*d.split(os.sep), SUMMARY])]
    listed = [d for lists in sorted(found[CELLS], key=lambda d: [*d.split(os.sep), CELLS])
              for d in cells_listed(Path(lists)) if (d / SUMMARY).is_file()]
    if not listed:  # one walk names each folder once
        return inside
    return list({d.resolve(): d for d in [*inside, *listed]}.values())


class RowCache:
    """The rows :func:`summary_row` gave for a results folder's runs, kept in bnexp's cache
    folder (:mod:`bnexp.support.cache`), one file per results folder, with the state of each
    run's summary.json and overrides.yaml (inode, size, times): a run whose two files are as
    they were is not read again. Rows with a warning (unreadable files) and files changed in
    the last :data:`~bnexp.support.cache.RACY_SECONDS` are never kept. The file is JSON made
    by bnexp (the cache folder is the user's own), dropped whole when bnexp's files changed,
    and each entry is checked for its shape as it is looked up; a file that cannot be used is
    an empty cache, and without a cache folder nothing is kept. A row is kept as its values
    and the number of its list of keys, which the runs of a folder share (:meth:`save`):
    the file is read at every table, and its keys were most of it."""

    def __init__(self, results: Path) -> None:
        try:
            name = hashlib.sha256(os.path.abspath(results).encode()).hexdigest()[:32]
            self.path: Optional[Path] = cache_dir() / "summary_rows" / f"{name}.json"
        except OSError:
            self.path = None
        self.code = f"{ROWS_FORMAT}:{package_digest()}"
        self.kept, self.keys = self.read()
        self.now = time.time_ns()
        self.rows: dict[str, list[Any]] = {}  # this command's rows to keep: [states, row]
        self.read_again = False  # whether a row to keep was read from its files

    def read(self) -> tuple[dict[str, Any], list[list[str]]]:
        """The file's rows and key lists (lists of strings) when it holds rows of this bnexp's
        code; empty otherwise."""
        try:
            held = json.loads(read_regular(self.path, TABLE_FILE)) if self.path else {}
        except (OSError, ValueError, RecursionError):
            return {}, []
        if not isinstance(held, dict) or held.get("code") != self.code:
            return {}, []
        rows, keys = held.get("rows"), held.get("keys")
        if not (isinstance(rows, dict) and isinstance(keys, list)
                and all(isinstance(names, list) and all(isinstance(k, str) for k in names) for names in keys)):
            return {}, []
        return rows, keys

    def row(self, run_dir: Path) -> Optional[dict[str, Any]]:
        """The run's row: the kept one when its files are unchanged, else :func:`summary_row`'s."""
        folder = os.fspath(run_dir)
        key = os.path.abspath(folder)
        states = [file_state(os.path.join(folder, SUMMARY), self.now),
                  file_state(os.path.join(folder, ".hydra", "overrides.yaml"), self.now)]
        kept = self.kept.get(key)
        if None not in states and isinstance(kept, list) and len(kept) == 3 and kept[0] == states:
            row = self.unpacked(kept[1:])
            result = self.unpacked(row.get(RESULT)) if row is not None else None
            if row is not None and result is not None:
                row[RESULT], row["run_dir"] = result, str(run_dir)  # a kept row's folder: as this walk spells it
                self.rows[key] = [states, row]
                return row
        row = summary_row(run_dir / SUMMARY)
        if row is not None and row.get("fingerprint") is not None and None not in states:
            self.rows[key] = [states, row]
            self.read_again = True
        return row

    def unpacked(self, entry: Any) -> Optional[dict[str, Any]]:
        """The mapping ``[number of its key list, its values]`` stands for (:meth:`save`);
        None for anything else."""
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and 0 <= entry[0] < len(self.keys)
                and isinstance(entry[1], list)):
            return None
        keys = self.keys[entry[0]]
        return dict(zip(keys, entry[1])) if len(keys) == len(entry[1]) else None

    def save(self) -> None:
        """Write the rows of this command's runs unless the file holds exactly those; a cache
        that cannot be written is passed over."""
        if self.path is None or (not self.read_again and self.rows.keys() == self.kept.keys()):
            return
        keys: dict[tuple[str, ...], int] = {}

        def packed(mapping: dict[str, Any]) -> list[Any]:
            """``[number of its key list, its values]``, its keys added to the file's lists."""
            return [keys.setdefault(tuple(mapping), len(keys)), list(mapping.values())]

        rows = {key: [states, *packed({**row, RESULT: packed(row[RESULT])})] for key, (states, row) in self.rows.items()}
        try:
            write_cache(self.path, json.dumps({"code": self.code, "keys": list(keys), "rows": rows}).encode())
        except (OSError, TypeError, ValueError):
            pass


def load_summaries(results: Path) -> pd.DataFrame:
    """Every run of :func:`run_dirs`, one row each (through the :class:`RowCache`), a run that
    sits there more than once counted once (:func:`counted_once`); seeds started from a
    replaced weights file are named (:func:`warn_pooled_weights`)."""
    cache = RowCache(Path(results))
    rows = [row for row in (cache.row(d) for d in run_dirs(results)) if row is not None]
    cache.save()
    frame = counted_once(pd.DataFrame(rows), Path(results))
    warn_pooled_weights(frame, Path(results))
    return frame


# Which copy of a run a table takes: a completed one first, then a diverged one; then the
# copy nearest the top of the tree (a backup is usually deeper: old/RUN), then by path.
STATUS_RANK = {"completed": 0, "diverged": 1}
SHOWN_COPIES = 5  # copies named one by one in the warning; the rest are counted


def copy_key(frame: pd.DataFrame) -> pd.Series:
    """What the copies of one run share: its :func:`run_identity` and its overrides (None for
    a run without an identity, which is never taken for a copy)."""
    given = sorted(c for c in frame.columns if c.startswith("overrides."))
    # each run's overrides as text joined by "|" (NaN: a key the run was not given)
    settings = functools.reduce(lambda a, b: a + "|" + b, (frame[c].map(str) for c in given)) if given else ""
    identity = frame["run_identity"]
    return (identity.fillna("").astype(str) + "|" + settings).where(identity.notna())


def counted_once(frame: pd.DataFrame, results: Path) -> pd.DataFrame:
    """``frame`` with one row per run: rows of the same :func:`run_identity` and the same
    overrides are copies of one run, of which the first by :data:`STATUS_RANK`, depth and path
    is kept. A warning names the copy taken and those left out. (Cells of a preset whose
    settings coincide, such as two rows of a table at one rho, are the same computation under
    other overrides: each row keeps its run.)"""
    if frame.empty or "run_identity" not in frame or not frame["run_identity"].notna().any():
        return frame
    copy = copy_key(frame)
    if not (copy.notna() & copy.duplicated()).any():
        return frame
    status = frame["status"] if "status" in frame else pd.Series(None, index=frame.index)
    order = pd.DataFrame({"_rank": status.map(lambda s: STATUS_RANK.get(s, 2)),
                          "_depth": frame["run_dir"].map(lambda d: len(Path(d).parts)), "run_dir": frame["run_dir"],
                          "_copy": copy})
    order = order.sort_values(["_rank", "_depth", "run_dir"], kind="stable")
    copies = order["_copy"].notna() & order.duplicated("_copy")
    kept = order[~copies]
    taken = dict(zip(kept["_copy"], kept["run_dir"]))
    ignored = order[copies].groupby("_copy", sort=False)["run_dir"].apply(list)
    lines = [f"took {taken[key]}, ignored {', '.join(dirs)}" for key, dirs in list(ignored.items())[:SHOWN_COPIES]]
    more = f"; and {len(ignored) - SHOWN_COPIES} more runs" if len(ignored) > SHOWN_COPIES else ""
    print_warning(f"{len(ignored)} run(s) under {results} sit there more than once (the same recorded fingerprint, "
                  f"data and starting weights): each is counted once: {'; '.join(lines)}{more}")
    return frame.loc[sorted(kept.index)].reset_index(drop=True)


def number_table(path: Path, read: Callable[[Path], pd.DataFrame], needs: Sequence[str], numeric: Sequence[str],
                 loses: str) -> Optional[pd.DataFrame]:
    """``read(path)``, a CSV file that must have the columns ``needs`` and numbers in the
    columns ``numeric`` (all when empty); None after a warning naming the file and what the
    command goes on without (``loses``) when it does not."""
    try:
        frame = parsed(path, read)
        missing = [c for c in needs if c not in frame]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r}")
        text = [c for c in numeric or frame.columns if len(frame) and not pd.api.types.is_numeric_dtype(frame[c])]
        if text:
            raise DataError(f"{path}: column {text[0]!r} holds text where numbers belong")
    except DataError as err:
        print_warning(f"{err}; {loses} left out")
        return None
    return frame


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """A run's metrics.csv (empty frame when it is missing or unusable)."""
    path = Path(run_dir) / "metrics.csv"
    frame = (number_table(path, lambda p: pd.read_csv(text_stream(p, TABLE_FILE)), ("epoch",), (), "its curves are")
             if path.is_file() else None)
    return pd.DataFrame() if frame is None else frame


def load_probes(run_dir: str | Path) -> pd.DataFrame:
    """A run's probes.csv (an empty frame with the columns when it is missing or unusable)."""
    from bnexp.probes.callback import COLUMNS, PROBES_FILE, read_probes  # here: bnexp.probes imports torch

    path = Path(run_dir) / PROBES_FILE
    frame = number_table(path, lambda p: read_probes(p.parent), COLUMNS, ("step", "value"),
                         "its probe values are") if path.is_file() else None
    return pd.DataFrame(columns=list(COLUMNS)) if frame is None else frame


def seconds_per_epoch(run_dir: str | Path, steps_per_epoch: float) -> float:
    """Training seconds per epoch from the ``time`` probe (data loading and compute, no
    evaluation or checkpoints): ``sum(epoch_s) / sum(epoch_steps) * steps_per_epoch``;
    NaN when the run has no such rows."""
    totals = load_probes(run_dir).query("probe == 'time'").groupby("quantity")["value"].sum()
    steps = totals.get("epoch_steps", 0.0)
    return float(totals["epoch_s"] / steps * steps_per_epoch) if steps else math.nan


def load_runs(path: str | Path) -> pd.DataFrame:
    """Every run under ``path``, one row each (a copy of a run counted once): its config as
    dotted columns (``optim.lr``, ``norm.name``), its summary (``status``, ``final_top1``,
    ``best_top1``, ``wall_seconds``, ...), the overrides its sweep gave (``overrides.<key>``),
    ``run_dir``, ``fingerprint``, and its last metrics.csv row as ``metrics.<column>``
    (``metrics.test_acc``: the last evaluation, also of a run that stopped early).

    >>> from bnexp.report import load_runs
    >>> runs = load_runs("results/cbn/table1")
    >>> runs.groupby(["tags.row", "act.name"])["final_top1"].agg(["mean", "std", "count"])
    """
    frame = load_summaries(Path(path))
    if frame.empty:
        return frame
    last = [load_metrics(run).tail(1).add_prefix("metrics.").reset_index(drop=True) for run in frame["run_dir"]]
    metrics = pd.concat([row if len(row) else pd.DataFrame(index=[0]) for row in last], ignore_index=True)
    return pd.concat([frame.drop(columns=["result_config", "run_identity", "starting_weights"], errors="ignore"), metrics], axis=1)
