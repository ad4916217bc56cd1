"""What the docs say about where outputs go is what bnexp does: results/README.md's folders
and the README's table of a run's files, checked against runs and sweeps made here; and the
README's main command as written: the protocol it composes, and where CIFAR-10 cannot be had,
its exit code, message and run directory."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

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


MAIN = ["train", "model=resnet20", "norm=cbn", "act=sigmoid"]  # the README's main command


def test_the_main_command_composes_the_protocol_the_readme_describes(capsys: pytest.CaptureFixture[str]) -> None:
    """README, "The main command": its config (``--cfg job``, as the README says) is the CBN
    paper's CIFAR protocol with CBN before each op and sigmoid activations."""
    code, out = run_cli([*MAIN, "--cfg", "job"], capsys)
    assert code == 0, out
    cfg = yaml.safe_load(out)
    assert (cfg["model"]["name"], cfg["norm"]["name"], cfg["norm"]["placement"], cfg["norm"]["amat"],
            cfg["act"]["name"], cfg["data"]["name"]) == ("resnet20", "cbn", "before_op", True, "sigmoid", "cifar10")
    assert (cfg["trainer"]["batch_size"], cfg["data"]["sampling"], cfg["trainer"]["epochs"]) == (128, "with_replacement", 120)
    assert (cfg["optim"]["name"], cfg["optim"]["lr"], cfg["optim"]["momentum"], cfg["optim"]["weight_decay"]) == \
        ("sgd", 0.1, 0.9, 5e-4)
    assert (cfg["schedule"]["milestones"], cfg["schedule"]["gamma"], cfg["schedule"]["unit"]) == ([60, 100], 0.1, "epoch")
    assert (cfg["data"]["augment"], cfg["data"]["padding"], cfg["data"]["root"], cfg["data"]["download"]) == \
        (True, 4, "data", True)


def test_the_main_command_offline_stops_in_its_readme_directory_and_names_the_offline_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The main command as written, where CIFAR-10 is not on disk and its download fails (the
    release's address made unreachable): exit 3, a message that names data=digits and does not
    advise the download that just failed, and the run directory the README names."""
    from torchvision.datasets import CIFAR10

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(CIFAR10, "url", "http://127.0.0.1:9/cifar-10-python.tar.gz")  # nothing listens there
    code, out = run_cli(MAIN, capsys)
    assert code == 3 and "the download failed" in out, out
    assert "data=digits" in out and "data.download=true" not in out, out
    (run,) = (tmp_path / "results" / "runs").iterdir()
    assert run.name == "act=sigmoid,model=resnet20,norm=cbn"
    assert f"`results/runs/{run.name}/`" in (ROOT / "README.md").read_text()


def demo_commands() -> list[list[str]]:
    """The bnexp commands of the Makefile's ``demo`` recipe, in order, as argument lists after ``bnexp``."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    return [shlex.split(part.split("$(BNEXP)", 1)[1].split(";", 1)[0]) for part in recipe.split("\n")
            if "$(BNEXP)" in part]


def test_make_demo_runs_the_main_command_briefly_then_the_cbn_claim() -> None:
    """README, "Set-up": make demo runs the main command for one epoch; only when it exits 3
    (CIFAR-10 cannot be had: the test above) the CBN claim with sigmoid and ReLU."""
    assert demo_commands() == [[*MAIN, "trainer.epochs=1"], ["claims", "cbn", "act=sigmoid,relu"]]
    assert "if [ $$rc -eq 3 ]" in (ROOT / "Makefile").read_text()
