"""What the docs say about where outputs go is what bnexp does: results/README.md's folders
and the README's table of a run's files, checked against runs and sweeps made here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bnexp.app.cells import CELLS
from bnexp.report.presets import load_preset
from tests.conftest import TINY, run_cli

ROOT = Path(__file__).resolve().parents[1]


def readme_files() -> dict[str, str]:
    """The README's table of a run's files: name -> its row."""
    text = (ROOT / "README.md").read_text()
    table = text.split("| file | content |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `([^`]+)`", row).group(1).rstrip("/"): row for row in rows}


def layout_bullets() -> list[str]:
    """The folders results/README.md's list names (`results/...` opening each bullet)."""
    return re.findall(r"^- `(results/[^`]+)`", (ROOT / "results" / "README.md").read_text(), re.MULTILINE)


def test_the_readme_names_every_file_a_run_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A run asking for every optional file (the best checkpoint, a probe; BN's weights log
    comes with the default norm) writes exactly the files of the table, each checkpoint with
    the checksum file its row names."""
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", *TINY, "trainer.keep_best=true", "probes=[loss]"], capsys)
    assert code == 0, out
    (run,) = (tmp_path / "results" / "runs").iterdir()
    written = {p.name for p in run.iterdir()}
    documented = readme_files()
    checksums = {name for name in written if name.endswith(".sha256")}
    assert written - checksums == set(documented)
    assert all(f"`{name}`" in documented[name.removesuffix(".sha256")] for name in checksums)


def test_results_readme_lists_the_folders_bnexp_makes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A run alone and an ad-hoc sweep's cells in results/runs/<overrides>/, the sweep's own
    folder in results/multirun/<overrides>/ with what the bullet says it holds, and each
    preset's folder in results/<paper>/<name>/ (results/quick/<paper>/<name>/ at toy scale)."""
    assert layout_bullets() == ["results/runs/<overrides>/", "results/multirun/<sweep overrides>/",
                                "results/<paper>/<name>/", "results/quick/<paper>/<name>/"]
    monkeypatch.chdir(tmp_path)
    assert run_cli(["train", *TINY], capsys)[0] == 0
    assert run_cli(["train", "-m", *TINY, "act=relu,tanh"], capsys)[0] == 0
    runs = sorted(p.name for p in (tmp_path / "results" / "runs").iterdir())
    expected_names = ",".join(sorted(o for o in TINY if o != "trainer.device=cpu"))
    assert runs == [f"act={a},{expected_names}" for a in ("relu", "tanh")] + [expected_names]
    (sweep,) = (tmp_path / "results" / "multirun").iterdir()
    assert sweep.name == f"act=relu,tanh,{expected_names}"
    assert sorted(p.name for p in sweep.iterdir()) == [CELLS, "multirun.yaml"]
    text = (ROOT / "results" / "README.md").read_text()
    assert f"`multirun.yaml` and `{CELLS}`" in text
    # every preset's folder: test_experiments.py::test_every_preset_composes_and_its_report_block_matches_the_published_cells
    for scale, folder in (("full", "results/cbn/table1"), ("quick", "results/quick/cbn/table1")):
        assert load_preset("cbn/table1", scale).results_dir == Path(folder)
