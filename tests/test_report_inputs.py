"""``bnexp table`` and ``bnexp plot`` on results folders made by someone else: a crafted file
is one warning line, values are escaped in every format, a folder that cannot be written is
one line, and a folder of many unrelated runs takes memory in proportion to the table."""

from __future__ import annotations

import _thread
import builtins
import io
import json
import os
import re
import threading
import tracemalloc
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests.conftest import run_cli

ACTS = {"relu": 80.0, "tanh": 70.0, "sigmoid": 60.0}  # a sweep over act: each run's final top-1


def write_run(root: Path, name: str, overrides: list[str], top1: float) -> Path:
    """A made-up finished run as bnexp writes one: the job's overrides, summary.json, metrics.csv."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    config = {"act": {"name": overrides[0].split("=", 1)[1]}, "trainer": {"seed": 0}}
    (run / "summary.json").write_text(json.dumps({"status": "completed", "final_top1": top1, "config": config}))
    (run / "metrics.csv").write_text(f"step,epoch,train_loss,test_acc\n4,1.0,2.0,{top1 - 5}\n8,2.0,1.5,{top1}\n")
    return run


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``results/``, relative to the current folder (tmp_path), holding a sweep over ``act``."""
    monkeypatch.chdir(tmp_path)
    for act, top1 in ACTS.items():
        write_run(Path("results"), act, [f"act={act}"], top1)
    return Path("results")


def rewrite_summary(path: Path, **fields: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# case: (the file of the relu run it damages, how, the warning after the file's name, the relu cell
# in the table: the run counts as failed, is left out (None), or keeps its result)
CASES: dict[str, tuple[str, Callable[[Path], object], str, str | None]] = {
    "summary_a_list": ("summary.json", lambda p: p.write_text("[1, 2]"),
                       re.escape("expected a JSON object, got a list; the run counts as failed"), "– (0 of 1; 1 failed)"),
    "top1_text": ("summary.json", lambda p: rewrite_summary(p, final_top1="abc"),
                  re.escape("final_top1 is 'abc', not a number; the run counts as failed"), "– (0 of 1; 1 failed)"),
    "json_200000_deep": ("summary.json", lambda p: p.write_text("[" * 200_000 + "]" * 200_000),
                         re.escape("nested too deeply to parse; the run counts as failed"), "– (0 of 1; 1 failed)"),
    "broken_overrides": (".hydra/overrides.yaml", lambda p: p.write_text("- act=relu\n- [unclosed\n"),
                         r"unreadable \(.*\); the run is left out", None),
    "garbage_metrics": ("metrics.csv", lambda p: p.write_text('\x00garbage"\n1,2,3\n"x'),
                        r"unreadable \(.*\); its curves are left out", "80.00 (1)"),
    "unknown_probe": ("probes.csv", lambda p: p.write_text("step,probe,layer,quantity,value\n0,nosuch,all,x,1.0\n"),
                      re.escape("unknown probe 'nosuch'; valid choices: eta_tau, grad_norm, grad_var, hessian, loss, "
                                "time, weights; its rows of 'nosuch' are left out"), "80.00 (1)"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_run_file_is_one_warning(case: str, results: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    name, damage, warning, relu = CASES[case]
    path = results / "relu" / name
    damage(path)
    read_by_table = name in ("summary.json", ".hydra/overrides.yaml")  # metrics and probes are for figures
    for args, reads in ((["table", str(results)], read_by_table), (["plot", str(results)], True)):
        code, out = run_cli(args, capsys)
        assert code == 0 and "Traceback" not in out, out
        warnings = [line for line in out.splitlines() if line.startswith("bnexp: warning:")]
        assert len(warnings) == reads, out
        assert not reads or re.fullmatch(f"bnexp: warning: {re.escape(str(path))}: {warning}", warnings[0]), out
        if args[0] == "table":
            cells = dict(re.findall(r"^\| (\w+) +\| (.+?) +\|$", out, re.MULTILINE))
            assert cells == {"act": "top-1", "sigmoid": "60.00 (1)", "tanh": "70.00 (1)"} | (
                {"relu": relu} if relu else {}), out
        else:
            assert (results / "plots" / "sweep.png").stat().st_size > 0


SCRIPT = "<script>alert(1)</script>"
MARKUP = r"x|y\input{z}$\frac{$"  # a markdown column break, a LaTeX command, matplotlib math that does not parse


def test_values_from_run_folders_are_text_in_every_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    write_run(Path("results"), "a", [f"act={SCRIPT}"], 80.0)
    write_run(Path("results"), "b", [f"act={MARKUP}"], 70.0)
    code, out = run_cli(["table", "results", "format=html"], capsys)  # the page embeds the curves
    assert code == 0 and out == f"{Path('results', 'table.html')}\n", out
    page = Path("results", "table.html").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page
    code, markdown = run_cli(["table", "results"], capsys)
    assert code == 0 and r"\<script>alert(1)\</script>" in markdown and r"x\|y\\input{z}$\\frac{$" in markdown
    assert not re.search(r"(?<!\\)<script", markdown)
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len(lines) == 4 and all(len(re.findall(r"(?<!\\)\|", line)) == 3 for line in lines), markdown
    code, latex = run_cli(["table", "results", "format=latex"], capsys)
    assert code == 0 and r"x|y\textbackslash{}input\{z\}\$\textbackslash{}frac\{\$" in latex and r"\input" not in latex


def read_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make writing under ``folder`` fail as a read-only folder does (the tests run as root,
    whom chmod does not stop): opening a file there to write, or making a folder there."""
    inside = folder.resolve()
    real_open, real_mkdir = builtins.open, os.mkdir

    def refuse(path: object) -> None:
        if isinstance(path, (str, os.PathLike)) and Path(os.path.abspath(path)).is_relative_to(inside):
            raise PermissionError(13, "Permission denied", str(path))

    def fake_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        if set(mode) & set("wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path: object, *args: object, **kwargs: object) -> None:
        refuse(path)
        real_mkdir(path, *args, **kwargs)

    for module in (builtins, io):
        monkeypatch.setattr(module, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


def test_a_read_only_results_folder_is_one_line(results: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    read_only(monkeypatch, results)
    code, out = run_cli(["table", str(results)], capsys)
    assert code == 0 and "70.00 (1)" in out, out  # a table is read, not written
    code, out = run_cli(["table", str(results), "format=html"], capsys)
    assert code == 2 and out == (f"bnexp: error: cannot write {results / 'table.html'} (PermissionError: Permission "
                                 "denied): choose another place with out=PATH\n"), out
    code, out = run_cli(["plot", str(results)], capsys)
    assert code == 2 and out == (f"bnexp: error: cannot write {results / 'plots'} (PermissionError: Permission "
                                 "denied): choose another place with out=PATH\n"), out
    code, out = run_cli(["plot", str(results), f"out={tmp_path / 'figures'}"], capsys)
    assert code == 0 and (tmp_path / "figures" / "sweep.png").is_file(), out
    assert not list(results.rglob("*.png")) and not list(results.rglob("*.html")) and not list(results.rglob(".*tmp"))


def traced_peak(body: Callable[[], object], limit: int) -> int:
    """The peak of the memory Python allocates while ``body`` runs (tracemalloc). Past
    ``limit`` the body is interrupted, so that a regression fails at once instead of filling
    the machine's memory (the peak it returns is then above ``limit``)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            if tracemalloc.get_traced_memory()[0] > limit:
                _thread.interrupt_main()
                return

    tracemalloc.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        try:
            body()
        finally:
            done.set()
            watcher.join()
    except KeyboardInterrupt:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def unrelated_runs(root: Path, n: int) -> None:
    """``n`` runs that share no setting: each its own activation, lr and width."""
    for i in range(n):
        write_run(root, f"run{i}", [f"act=a{i}", f"optim.lr=0.{i + 1}", f"model.width={i + 1}"], float(i))


def test_memory_grows_with_the_table_not_with_combinations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small, large = 10, 40
    unrelated_runs(tmp_path / "small", small)
    unrelated_runs(tmp_path / "large", large)
    assert run_cli(["table", str(tmp_path / "small")], capsys)[0] == 0  # imports and caches, outside the measure
    base = traced_peak(lambda: run_cli(["table", str(tmp_path / "small")], capsys), limit=10**9)
    # Each run is one line of its table, whatever its settings: 4x the runs make a table 4x
    # as long, so memory that grows with the table takes at most 4x the small folder's peak,
    # and less for what does not grow with it (a 5th peak is slack for the allocator). A
    # table over every combination of the values of the 3 keys that vary would take 4^3 = 64x.
    limit = 5 * base
    peak = traced_peak(lambda: run_cli(["table", str(tmp_path / "large")], capsys), limit)
    out = capsys.readouterr().out
    assert peak <= limit, f"{peak} bytes at the peak for {large} runs, {base} for {small}"
    code, out = run_cli(["table", str(tmp_path / "large")], capsys)
    rows = [line for line in out.splitlines() if re.match(r"\| a\d+ ", line)]
    assert code == 0 and len(rows) == large and all(re.search(r" \(1\) +\|$", row) for row in rows), out


def test_a_run_without_a_key_the_others_vary_has_its_own_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, "a", ["act=relu", "optim.lr=0.1"], 80.0)
    write_run(tmp_path, "b", ["act=tanh"], 70.0)  # from another sweep: its lr is the default
    code, out = run_cli(["table", str(tmp_path)], capsys)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("|")]
    assert code == 0 and rows[2:] == [["relu", "0.1", "80.00 (1)"], ["tanh", "(not set)", "70.00 (1)"]], out


def test_a_metric_that_is_not_a_number_is_one_line(results: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for act, seconds in (("relu", "abc"), ("tanh", 12.0), ("sigmoid", 14.0)):
        rewrite_summary(results / act / "summary.json", wall_seconds=seconds)
    code, out = run_cli(["table", str(results), "metric=wall_seconds"], capsys)
    summary = results / "relu" / "summary.json"
    assert code == 0 and [line for line in out.splitlines() if line.startswith("bnexp:")] == [
        f"bnexp: warning: {summary}: wall_seconds is 'abc', not a number; the run counts as failed"], out
    assert "12.00 (1)" in out and "– (0 of 1; 1 failed)" in out, out
    code, out = run_cli(["table", str(results), "metric=status"], capsys)
    assert code == 2 and out.splitlines()[1:] == [  # after the warning about relu's summary, again
        "bnexp: error: metric='status': no run recorded it as a number; valid: top1, top5, seconds_per_epoch, "
        "final_top1"], out
