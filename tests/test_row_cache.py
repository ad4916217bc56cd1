"""The rows of a results folder's summaries kept between commands (``RowCache``) and the
one walk that finds the runs: what a table reads is what it reads without them."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pandas as pd
import pytest

from bnexp.app.cells import CELLS
from bnexp.report import results
from bnexp.report.results import RowCache, load_summaries, run_dirs
from bnexp.support import cache
from tests.test_table import EXPECTED, LAYOUT, write_runs


def uncached(folder: Path) -> pd.DataFrame:
    """What load_summaries gives with every row read from its files."""
    rows = [row for row in (results.summary_row(d / "summary.json") for d in run_dirs(folder)) if row is not None]
    return results.counted_once(pd.DataFrame(rows), folder)


def rows_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The run folders whose summary.json summary_row reads from now on."""
    read: list[str] = []
    original = results.summary_row

    def counting(path: Path):  # noqa: ANN202 (summary_row's own signature)
        read.append(path.parent.name)
        return original(path)

    monkeypatch.setattr(results, "summary_row", counting)
    return read


def test_a_second_table_reads_the_kept_rows_and_tabulates_the_same(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With files older than the racy window, the first load keeps every row, the second reads
    none of the summaries and gives the same frame and table; the frame equals one read
    without the cache, and a run reached by another spelling of its folder keeps that spelling."""
    from bnexp.report.table import build, render

    monkeypatch.setattr(cache, "RACY_SECONDS", 0.0)
    write_runs(tmp_path / "runs")
    first = load_summaries(tmp_path / "runs")
    read = rows_read(monkeypatch)
    second = load_summaries(tmp_path / "runs")
    assert read == []
    pd.testing.assert_frame_equal(second, first)
    pd.testing.assert_frame_equal(second, uncached(tmp_path / "runs"))
    assert render(build(LAYOUT, second), "markdown", "Test table") == EXPECTED
    monkeypatch.chdir(tmp_path)
    read.clear()
    relative = load_summaries(Path("runs"))
    assert read == [] and set(relative["run_dir"]) == {str(Path("runs") / f"run{i}") for i in range(12)}


def test_a_changed_added_or_removed_run_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A summary rewritten in place with the same size (only its modification time tells), one
    replaced by a new file, a run's overrides.yaml appearing, a new run and a removed one: each
    changed run is read again, the others come from the cache, and the frame is the uncached one."""
    monkeypatch.setattr(cache, "RACY_SECONDS", 0.0)
    write_runs(tmp_path)
    load_summaries(tmp_path)
    read = rows_read(monkeypatch)
    summary = tmp_path / "run0" / "summary.json"
    text = summary.read_text()
    assert '"final_top1": 80.0' in text
    stat = summary.stat()
    summary.write_text(text.replace('"final_top1": 80.0', '"final_top1": 70.0'))
    os.utime(summary, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    replaced = tmp_path / "run1" / "new.json"
    replaced.write_text((tmp_path / "run1" / "summary.json").read_text().replace("81.0", "71.0"))
    os.replace(replaced, tmp_path / "run1" / "summary.json")
    (tmp_path / "run2" / ".hydra").mkdir()
    (tmp_path / "run2" / ".hydra" / "overrides.yaml").write_text("- act=tanh\n")
    (tmp_path / "run3" / "summary.json").unlink()
    (tmp_path / "run3").rmdir()
    (tmp_path / "run99").mkdir()
    (tmp_path / "run99" / "summary.json").write_text(json.dumps({"status": "completed", "final_top1": 1.0,
                                                                 "config": {"trainer": {"seed": 5}}}))
    frame = load_summaries(tmp_path)
    assert sorted(read) == ["run0", "run1", "run2", "run99"]
    pd.testing.assert_frame_equal(frame, uncached(tmp_path))
    assert set(frame["final_top1"]) >= {70.0, 71.0} and frame["overrides.act"].dropna().tolist() == ["tanh"]
    kept = json.loads(RowCache(tmp_path).path.read_text())["rows"]
    assert len(kept) == len(frame) == 12 and not any(key.endswith("run3") for key in kept)


def test_recent_files_and_rows_with_warnings_are_never_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Files written within the racy window are read every time; an unreadable summary (a failed
    row) and unreadable overrides (a run left out) warn every time; a cache file that is not
    JSON, holds entries of the wrong shape or was written by other bnexp code is an empty
    cache; without a cache folder, every row is read."""
    write_runs(tmp_path)
    read = rows_read(monkeypatch)
    monkeypatch.setattr(cache, "RACY_SECONDS", 1e9)  # every file is recent
    load_summaries(tmp_path)
    load_summaries(tmp_path)
    assert len(read) == 24 and not RowCache(tmp_path).path.exists()
    monkeypatch.setattr(cache, "RACY_SECONDS", 0.0)
    (tmp_path / "run0" / "summary.json").write_text("{not json")
    (tmp_path / "run1" / ".hydra").mkdir()
    (tmp_path / "run1" / ".hydra" / "overrides.yaml").write_text("{a mapping: 1}\n")
    for _ in range(2):
        read.clear()
        frame = load_summaries(tmp_path)
        err = capsys.readouterr().err
        assert "run0/summary.json: unreadable" in err and "run1/.hydra/overrides.yaml: expected a list" in err
        assert len(frame) == 11 and "run0" in read and "run1" in read
    assert sorted(read) == ["run0", "run1"]
    path, run2 = RowCache(tmp_path).path, tmp_path / "run2"
    held = json.loads(path.read_text())
    states = [cache.file_state(run2 / "summary.json", time.time_ns()), []]
    assert held["rows"][str(run2)][0] == states
    number, values = held["rows"][str(run2)][1:]
    values = [{"not": "packed"} if key == "result_config" else v for key, v in zip(held["keys"][number], values)]
    for text in ("{not json", "[1, 2]", json.dumps({**held, "rows": {str(run2): [states, number, values]}}),
                 json.dumps({**held, "code": "other code"}),
                 json.dumps({**held, "rows": {str(run2): [1, 2, 3]}}),
                 json.dumps({**held, "rows": {str(run2): [states, "no row"]}}),
                 json.dumps({**held, "rows": {str(run2): [states, 0, ["fewer values than keys"]]}}),
                 json.dumps({**held, "rows": {str(run2): [states, len(held["keys"]), []]}}),
                 json.dumps({**held, "keys": [[1, 2]] * len(held["keys"])})):
        path.write_text(text)
        read.clear()
        frame = load_summaries(tmp_path)
        assert "run2" in read
        pd.testing.assert_frame_equal(frame, uncached(tmp_path))
    monkeypatch.delenv(cache.CACHE_ENV)
    monkeypatch.delenv("HOME")
    monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    read.clear()
    pd.testing.assert_frame_equal(load_summaries(tmp_path), uncached(tmp_path))
    assert len(read) == 24


def rglob_run_dirs(folder: Path) -> list[Path]:
    """run_dirs as it was written before the one walk (the reference it must equal)."""
    inside = [p.parent for p in sorted(Path(folder).rglob("summary.json"))]
    listed = [d for lists in sorted(Path(folder).rglob(CELLS)) for d in results.cells_listed(lists.parent)]
    unique = {d.resolve(): d for d in [*inside, *(d for d in listed if (d / "summary.json").is_file())]}
    return list(unique.values())


def test_one_walk_finds_the_runs_rglob_finds(tmp_path: Path) -> None:
    """Nested runs (also runs inside a run's folder, named before and after summary.json), a
    hidden folder, folders whose names sort otherwise as text than as paths (``a-b``, ``a,c``
    beside ``a``), a folder named summary.json, a symbolic link to a run's
    folder (not followed), to a summary file and to nothing, and a sweep folder listing cells
    elsewhere (one also under the tree): the same folders in the same order as two rglob walks."""
    write_runs(tmp_path / "tree" / "a")
    for hidden in (".hidden", "a-b", "a,c", "x/b", "x/t"):  # x/b and x/t runs inside the run x
        (tmp_path / "tree" / hidden / "r").mkdir(parents=True)
        (tmp_path / "tree" / hidden / "r" / "summary.json").write_text("{}")
    (tmp_path / "tree" / "x" / "summary.json").write_text("{}")
    (tmp_path / "tree" / "odd" / "summary.json").mkdir(parents=True)
    (tmp_path / "tree" / "link").symlink_to(tmp_path / "tree" / "a" / "run0")
    (tmp_path / "tree" / "file_link").mkdir()
    (tmp_path / "tree" / "file_link" / "summary.json").symlink_to(tmp_path / "tree" / "a" / "run1" / "summary.json")
    (tmp_path / "tree" / "dangling").mkdir()
    (tmp_path / "tree" / "dangling" / "summary.json").symlink_to(tmp_path / "nowhere.json")
    write_runs(tmp_path / "elsewhere")
    (tmp_path / "tree" / "sweep").mkdir()
    (tmp_path / "tree" / "sweep" / CELLS).write_text("../../elsewhere/run4\n../a/run5\n../../elsewhere/run0\nnope\n")
    walked = run_dirs(tmp_path / "tree")
    assert walked == rglob_run_dirs(tmp_path / "tree") and len(walked) == 12 + 3 + 2 + 5
    (tmp_path / "tree" / "sweep" / CELLS).unlink()
    assert run_dirs(tmp_path / "tree") == rglob_run_dirs(tmp_path / "tree")
    assert run_dirs(tmp_path / "missing") == rglob_run_dirs(tmp_path / "missing") == []


def test_select_matches_each_entry_as_same_does() -> None:
    """select's per-value memo gives what same() gives entry by entry, on a column mixing
    numbers, their text, booleans, NaN, None, lists and tuples."""
    from bnexp.report.layouts import same
    from bnexp.report.selection import select

    entries = [1, 1.0, "1", "1.0", True, False, 0, "True", "true", math.nan, None, [15, 25], "[15, 25]", 2.5, "x",
               (1, 2), (1.0, 2)]
    frame = pd.DataFrame({"k": pd.Series(entries * 2, dtype=object), "n": range(2 * len(entries))})
    for value in [*entries, "2.50", 0.0, "(1.0, 2)"]:
        expected = [i for i, entry in enumerate(entries * 2) if same(entry, value)]
        assert select(frame, {"k": value})["n"].tolist() == expected, value
    assert select(frame, {"missing": 1}).empty
