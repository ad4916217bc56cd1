"""Where a sweep's cells live (bnexp/app/cells.py): an ad-hoc sweep's folder lists its cells,
which train where single runs do, so a grown sweep trains only its new cells; a folder of
the earlier layout runs again in place; ``--dry-run`` says what runs, resumes and is
skipped, and how long it should take."""

from __future__ import annotations

import csv
import json
import shlex
import shutil
from pathlib import Path

import pytest

from bnexp.app.cells import CELLS, listed
from tests.conftest import TINY, run_cli


def sweep_folder(out: str) -> Path:
    """The sweep folder a dry run names on its first line (``N jobs in FOLDER:``)."""
    return Path(out.splitlines()[0].split(" jobs in ", 1)[1].rstrip(":"))


def summaries(root: Path) -> dict[Path, bytes]:
    return {p.parent.resolve(): p.read_bytes() for p in root.rglob("summary.json")}


def test_a_grown_sweep_trains_only_its_new_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep without a seed, then the same with trainer.seed=0,1: seed 0 is the run that
    trained already (same settings, another name), found and not trained again."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(["train", "-m", *TINY, "act=relu,tanh"], capsys)[0] == 0
    first = summaries(tmp_path / "results")
    assert len(first) == 2 and all(d.parent == (tmp_path / "results" / "runs").resolve() for d in first)
    grown = ["train", "-m", *TINY, "act=relu,tanh", "trainer.seed=0,1"]
    code, out = run_cli([*grown, "--dry-run"], capsys)
    assert code == 0 and "2 to run, 0 to resume, 2 finished (skipped); projected: about" in out, out
    folder = sweep_folder(out)
    code, out = run_cli(grown, capsys)
    assert code == 0 and "sweep finished: 4 cells: 2 completed, 0 diverged, 0 failed, 2 skipped" in out, out
    after = summaries(tmp_path / "results")
    assert len(after) == 4 and all(after[d] == first[d] for d in first)  # the first two untouched
    assert sorted(p.name for p in folder.iterdir()) == [CELLS, "multirun.yaml"]  # the folder holds no run
    assert sorted(d.resolve() for d in listed(folder)) == sorted(after)
    code, table = run_cli(["table", str(folder), "rows=act"], capsys)
    assert code == 0 and [line.count("(2)") for line in table.splitlines() if line.startswith("| relu")
                          or line.startswith("| tanh")] == [1, 1], table
    code, out = run_cli(grown, capsys)  # the same command again: every cell is there
    assert code == 0 and "4 cells: 0 completed, 0 diverged, 0 failed, 4 skipped" in out, out


def test_a_sweep_folder_of_the_earlier_layout_runs_again_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A folder made as ad-hoc sweeps made them before their cells were listed (each cell in
    it, named after its overrides; multirun.yaml; no list): the same command skips its
    cells there, and a grown sweep finds them."""
    monkeypatch.chdir(tmp_path)
    command = ["train", "-m", *TINY, "act=relu,tanh"]
    earlier = "hydra.sweep.subdir='${cell_name:${hydra:overrides.task}}'"  # the subdir train.yaml had then
    assert run_cli([*command, earlier], capsys)[0] == 0
    (folder,) = (tmp_path / "results" / "multirun").iterdir()
    (folder / CELLS).unlink()
    made = summaries(folder)
    assert len(made) == 2 and not (tmp_path / "results" / "runs").exists()
    code, out = run_cli(command, capsys)
    assert code == 0 and "2 cells: 0 completed, 0 diverged, 0 failed, 2 skipped" in out, out
    assert not (tmp_path / "results" / "runs").exists() and not (folder / CELLS).exists()
    code, table = run_cli(["table", str(folder)], capsys)
    assert code == 0 and table.count("(1)") == 2, table
    code, out = run_cli(["train", "-m", *TINY, "act=relu,tanh", "trainer.seed=0,1"], capsys)
    assert code == 0 and "4 cells: 2 completed, 0 diverged, 0 failed, 2 skipped" in out, out
    assert summaries(folder) == made and len(summaries(tmp_path / "results" / "runs")) == 2


def test_dry_run_says_what_runs_resumes_and_is_skipped_and_how_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """One cell finished (it trained 120 s of its 4 steps), one stopped at step 2, one never
    ran: 1.5 runs' worth left at the finished cell's pace."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(["train", "-m", *TINY, "act=relu,tanh"], capsys)[0] == 0
    runs = tmp_path / "results" / "runs"
    (relu,) = runs.glob("act=relu,*")
    (tanh,) = runs.glob("act=tanh,*")
    rows = list(csv.DictReader(open(relu / "metrics.csv")))
    rows[-1]["seconds"] = "120.0"
    with open(relu / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = json.loads((tanh / "summary.json").read_text()) | {"status": "preempted"}
    (tanh / "summary.json").write_text(json.dumps(summary))
    (tanh / "checkpoint.pt").rename(tanh / "step-000000002.pt")
    (tanh / "checkpoints").mkdir()
    (tanh / "step-000000002.pt").rename(tanh / "checkpoints" / "step-000000002.pt")
    before = sorted(tmp_path.rglob("*"))
    code, out = run_cli(["train", "-m", *TINY, "act=relu,tanh,sigmoid", "--dry-run"], capsys)
    assert code == 0, out
    labels = {line.split("  ")[3].split()[-1]: line.split("  ")[2] for line in out.splitlines()[1:4]}
    assert labels == {"act=relu": "[completed]", "act=tanh": "[preempted: resumes from step 2]",
                      "act=sigmoid": "[to run]"}, out
    seconds = 120.0 * (1 + (1 - 2 / 4))  # one run to train, half of one to resume, at 120 s a run
    assert out.splitlines()[4] == (f"1 to run, 1 to resume, 1 finished (skipped); projected: about "
                                   f"{seconds / 60:.1f} min (the median of 1 finished cell, 2.0 min each)"), out
    assert sorted(tmp_path.rglob("*")) == before  # a dry run writes nothing


def test_a_list_naming_other_places_is_read_as_paths_only(tmp_path: Path) -> None:
    """cells.txt comes with a results folder from elsewhere: its lines are paths, blank and
    repeated ones are passed over, and only directories holding a summary.json are runs."""
    from bnexp.report.results import run_dirs

    folder = tmp_path / "sweep"
    run = tmp_path / "elsewhere" / "run"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    folder.mkdir()
    (folder / CELLS).write_text("../elsewhere/run\n\n../elsewhere/run\n../nothing here\nx\0y\n")
    assert listed(folder) == [run, tmp_path / "nothing here"]
    assert [d.resolve() for d in run_dirs(folder)] == [run.resolve()]
    shutil.rmtree(run)
    assert run_dirs(folder) == []


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands(after: str) -> list[list[str]]:
    """The commands of the README's first bash block after the text ``after``, comments cut."""
    block = README.read_text().split(after, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]


def test_the_readmes_first_sweep_as_written_lists_its_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """README, "Sweeps": its first command (2 norms x 5 activations x 3 seeds, full protocol)
    with ``--dry-run``: 30 cells, each where the same run alone trains, all to run; nothing
    written."""
    monkeypatch.chdir(tmp_path)
    (sweep,) = readme_commands("(Hydra multirun):")
    assert sweep[:3] == ["bnexp", "train", "-m"]
    code, out = run_cli([*sweep[1:], "--dry-run"], capsys)
    assert code == 0, out
    assert out.splitlines()[0] == "30 jobs in results/multirun/act=sigmoid,tanh,relu,selu,swish,norm=bn,cbn," \
                                  "trainer.seed=0,1,2:", out
    homes = [line.split("  ")[1] for line in out.splitlines()[1:31]]
    assert len(set(homes)) == 30 and all(Path(h).parent == Path("results/runs") for h in homes)
    assert "30 to run, 0 to resume, 0 finished (skipped)" in out and not list(tmp_path.iterdir()), out


@pytest.mark.slow
def test_the_readme_sweep_commands_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """README, "Sweeps": a digits sweep, the same grown by a seed (the first seed found, not
    trained again), its table and its figure, run as the README writes them."""
    monkeypatch.chdir(tmp_path)
    dry, first, grown, table, plot = readme_commands("which need no download:")
    assert {c[0] for c in (dry, first, grown, table, plot)} == {"bnexp"}
    code, out = run_cli(dry[1:], capsys)
    assert code == 0 and "2 to run, 0 to resume, 0 finished (skipped)" in out and not Path("results").exists(), out
    code, out = run_cli(first[1:], capsys)
    assert code == 0 and "sweep finished: 2 cells: 2 completed" in out, out
    code, out = run_cli(grown[1:], capsys)
    assert code == 0 and "sweep finished: 4 cells: 2 completed, 0 diverged, 0 failed, 2 skipped" in out, out
    code, out = run_cli(table[1:], capsys)
    assert code == 0 and [line.split("|")[1].strip() for line in out.splitlines() if "(2)" in line] == ["relu", "tanh"]
    code, out = run_cli(plot[1:], capsys)
    assert code == 0 and all(Path(line).is_file() for line in out.split()) and "sweep.png" in out, out


def test_plot_of_a_listing_sweep_draws_the_probes_of_its_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``bnexp plot`` of an ad-hoc sweep folder finds the probes.csv of the cells it lists
    (they train outside it, where single runs do)."""
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", "-m", *TINY, "act=relu,tanh", "probes=[loss]"], capsys)
    assert code == 0, out
    (folder,) = (p.parent for p in (tmp_path / "results" / "multirun").rglob(CELLS))
    assert not list(folder.rglob("probes.csv")) and len(listed(folder)) == 2
    code, out = run_cli(["plot", str(folder)], capsys)
    assert code == 0 and (folder / "plots" / "probe_loss.png").is_file(), out
