"""Checkpoints and run folders from elsewhere: loading never runs code from a file, and a
damaged, mismatched or unwritable run folder is one line and exit 2 under eval, export and
a re-run. Each test is named in docs/resilience.md's fault table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from bnexp.engine import checkpoint
from bnexp.support.errors import EXIT_CONFIG
from tests.conftest import TINY, run_cli

DOCS = Path(__file__).resolve().parents[1] / "docs" / "resilience.md"


class RunsCode:
    """Unpickled in full, this calls ``exec``, as a hostile checkpoint would: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``results/`` with one finished TINY run, trained in the default run
    directory as ``bnexp train *TINY`` names it."""
    root = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        from bnexp.cli import main

        main(["train", *TINY])
    return root


@pytest.fixture
def run(finished: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the finished run, with the working directory where ``bnexp train *TINY`` finds
    it; its path from there, as a user would type it."""
    shutil.copytree(finished / "results", tmp_path / "results")
    monkeypatch.chdir(tmp_path)
    return next(Path("results", "runs").iterdir())


def rewrite(path: Path, change: dict, old_format: bool = False) -> None:
    """Save ``path``'s payload again with ``change`` merged in (and numpy's random state as the
    array bnexp stored before 2026-11-23 if ``old_format``), with a matching ``.sha256``."""
    payload = torch.load(path, weights_only=True) | change
    if old_format:
        payload["rng"][0]["numpy"] = np.random.get_state()
    checkpoint.save_with_checksum(payload, path)


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("bnexp: error:")]


def as_preempted(run: Path) -> Path:
    """Turn the finished run into one stopped at step 2 with a periodic checkpoint to resume
    from; that checkpoint's path."""
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "status": "preempted", "steps": 2}))
    periodic = checkpoint.periodic_path(run, 2)
    periodic.parent.mkdir()
    shutil.copy(run / checkpoint.FINAL, periodic)
    shutil.copy(checkpoint.checksum_path(run / checkpoint.FINAL), checkpoint.checksum_path(periodic))
    (run / checkpoint.FINAL).unlink()
    return periodic


# Each path that loads a checkpoint: (the file it loads, the command line) for a run folder.
PATHS = {
    "init_from": lambda run: (run / checkpoint.FINAL, ["train", *TINY, f'trainer.init_from="{run}"']),
    "resume_file": lambda run: (run / checkpoint.FINAL, ["train", *TINY, "trainer.max_steps=6",
                                                         f'trainer.resume="{run / checkpoint.FINAL}"']),
    "auto_resume": lambda run: (as_preempted(run), ["train", *TINY]),
    "eval": lambda run: (run / checkpoint.FINAL, ["eval", str(run)]),
    "export": lambda run: (run / checkpoint.FINAL, ["export", str(run)]),
}


@pytest.mark.parametrize("old_format", [False, True], ids=["format-now", "format-before-2026-11-23"])
@pytest.mark.parametrize("path", PATHS)
def test_checkpoint_that_would_run_code_is_refused(path: str, old_format: bool, run: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose unpickling calls exec, with a matching .sha256 beside it: never
    unpickled in full on any path; one line, exit 2, the run folder's files unchanged."""
    marker = tmp_path / "marker"
    file, args = PATHS[path](run)
    rewrite(file, {"extra": RunsCode(marker)}, old_format)
    before = files_of(run / checkpoint.CHECKPOINT_DIR) if path == "auto_resume" else files_of(run)
    code, out = run_cli(args, capsys)
    assert not marker.exists(), "the checkpoint's code ran"
    assert code == EXIT_CONFIG and "Traceback" not in out, out
    lines = error_lines(out)
    assert len(lines) == 1 and lines[0].startswith("bnexp: error: refused checkpoint "), out
    assert f"{file}: unpickling it needs {'numpy' if old_format else 'exec'}" in lines[0]
    assert "docs/resilience.md (\"Checkpoints of older versions\")" in lines[0]
    assert (files_of(run / checkpoint.CHECKPOINT_DIR) if path == "auto_resume" else files_of(run)) == before


# The one unpickler of bnexp's own: CIFAR batches, restricted to numpy arrays and containers.
RESTRICTED_UNPICKLER = ("cifar.py", "class BatchUnpickler(pickle.Unpickler):")


def test_no_bnexp_code_unpickles_in_full() -> None:
    """weights_only=True is the only way bnexp's own code (bnexp/ and hydra_plugins/) calls
    torch.load, and the restricted CIFAR unpickler its only use of python's pickle reader."""
    root = Path(checkpoint.__file__).parents[2]  # bnexp/engine/checkpoint.py -> the checkout
    sources = [*(root / "bnexp").rglob("*.py"), *(root / "hydra_plugins").rglob("*.py")]
    lines = [(p.name, line.strip()) for p in sources for line in p.read_text().splitlines()]
    assert RESTRICTED_UNPICKLER in lines
    calls = [(name, line) for name, line in lines
             if ("torch.load(" in line and "weights_only=True" not in line)
             or (any(call in line for call in ("pickle.load(", "pickle.loads(", "pickle.Unpickler"))
                 and (name, line) != RESTRICTED_UNPICKLER)]
    assert calls == []


def conversion_command() -> str:
    """The shell command docs/resilience.md gives to convert an older checkpoint."""
    section = DOCS.read_text().split("### Checkpoints of older versions", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def convert(*paths: Path) -> subprocess.CompletedProcess:
    """The documented conversion command on ``paths``, run from the checkout (where ``scripts/`` is)."""
    command = conversion_command().replace("RUN/checkpoint.pt", " ".join(str(p.absolute()) for p in paths))
    return subprocess.run(["bash", "-c", command.replace("python ", f"{sys.executable} ", 1)], capture_output=True,
                          text=True, cwd=DOCS.parents[1])


def test_older_checkpoint_is_refused_then_converted_by_the_documented_command(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["eval", str(run)], capsys)[0] == 0
    expected = json.loads((run / "eval.json").read_text())["synthetic/test"]
    (run / "eval.json").unlink()
    np.random.seed(7)
    state = np.random.get_state()
    rewrite(run / checkpoint.FINAL, {}, old_format=True)
    code, out = run_cli(["eval", str(run)], capsys)
    assert code == EXIT_CONFIG and "unpickling it needs numpy" in out and not (run / "eval.json").exists()
    done = convert(run / checkpoint.FINAL)
    assert done.returncode == 0 and done.stdout == (f"converted: {(run / checkpoint.FINAL).absolute()} (its numpy random "
                                                    "state, read with numpy's array globals allowed; nothing else)\n"), \
        done.stdout + done.stderr
    payload = checkpoint.load(run / checkpoint.FINAL)  # weights_only=True, checksum verified
    np.random.seed(0)
    checkpoint.restore_rng(payload["rng"][0])
    assert np.array_equal(np.random.get_state()[1], state[1]) and np.random.get_state()[2] == state[2]
    code, out = run_cli(["eval", str(run)], capsys)
    assert code == 0, out
    again = json.loads((run / "eval.json").read_text())["synthetic/test"]
    assert (again["test_loss"], again["test_acc"]) == (expected["test_loss"], expected["test_acc"])


def test_the_conversion_leaves_today_s_files_alone_and_never_launders_a_hostile_one(run: Path, tmp_path: Path) -> None:
    """The documented conversion unpickled every file in full: a file already in today's format
    was rewritten, and a hostile one ran its code, was written again clean and got a fresh
    .sha256 ("converted"). Today's file is left as it is, a hostile or damaged one refused."""
    final = run / checkpoint.FINAL
    hostile, damaged = final.with_name("hostile.pt"), final.with_name("damaged.pt")
    shutil.copy(final, damaged)
    shutil.copy(checkpoint.checksum_path(final), checkpoint.checksum_path(damaged))
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"x")
    marker = tmp_path / "marker"
    checkpoint.save_with_checksum({**torch.load(final, weights_only=True), "rng": RunsCode(marker)}, hostile)
    before = files_of(run)
    done = convert(final, hostile, damaged)
    assert done.returncode == 1 and not marker.exists(), done.stdout + done.stderr
    assert files_of(run) == before  # not one byte changed, no checksum written
    lines = done.stdout.splitlines()
    assert lines[0] == f"left as it is: {final.absolute()} (already today's format)"
    assert lines[1] == (f"refused: {hostile.absolute()} (not converted, left as it is): unpickling it needs exec, "
                        "more than a checkpoint of an older bnexp holds")
    assert lines[2] == (f"refused: {damaged.absolute()} (not converted, left as it is): ValueError: it does not match "
                        "damaged.pt.sha256 (damaged, or changed since)")


def test_eval_of_a_damaged_checkpoint_is_one_line(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = run / checkpoint.FINAL
    final.write_bytes(final.read_bytes()[:1000])
    before = files_of(run)
    for command in ("eval", "export"):
        code, out = run_cli([command, str(run)], capsys)
        assert code == EXIT_CONFIG and "Traceback" not in out, out
        assert error_lines(out) == [line for line in out.splitlines() if line] and \
            f"damaged checkpoint {final}: its sha256 is" in out
    assert files_of(run) == before


DAMAGED_CONFIGS = {
    "not yaml": ("model: [resnet20\n", "damaged run config {}: ParserError"),
    "binary": (b"\x80\x81\xfe\xff" * 8, "damaged run config {}: UnicodeDecodeError"),
    "a list": ("- model\n- norm\n", "damaged run config {}: not a mapping with the sections model, norm, act, data"),
    "a bad interpolation": ("model: ${nope.nope}\nnorm: {}\nact: {}\ndata: {}\n", "damaged run config {}: "),
    "cut short": (None, "no longer holds the settings checkpoint.pt was trained with (probes: [] there, '<unset>' "
                        "here; 'there' is the checkpoint)"),
}


def damage(config: Path, kind: str) -> None:
    text = DAMAGED_CONFIGS[kind][0]
    if text is None:  # cut at a line end: valid YAML that lost its last setting
        text = "".join(config.read_text().splitlines(keepends=True)[:-1])
    (config.write_bytes if isinstance(text, bytes) else config.write_text)(text)


@pytest.mark.parametrize("kind", DAMAGED_CONFIGS)
def test_damaged_run_config_is_one_line_and_noticed_by_the_rerun(kind: str, run: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = run / "config.yaml"
    damage(config, kind)
    before = files_of(run)
    for command in ("eval", "export"):
        code, out = run_cli([command, str(run)], capsys)
        assert code == EXIT_CONFIG and "Traceback" not in out, out
        assert error_lines(out) == [line for line in out.splitlines() if line]
        assert DAMAGED_CONFIGS[kind][1].format(config) in out and str(config) in out
    assert files_of(run) == before
    code, out = run_cli(["train", *TINY], capsys)  # the same command: the run's results stand, the damage is said
    assert code == 0 and "skipped: already completed" in out and "Traceback" not in out, out
    warning = "WARNING: its config.yaml is unusable: "
    assert warning in out and "Its metrics and summary stand; trainer.resume=never trains it again" in out
    assert warning in (run / "train.log").read_text()  # the only file the re-run changes: its log, appended
    assert {k: v for k, v in files_of(run).items() if k != "train.log"} == {k: v for k, v in before.items()
                                                                            if k != "train.log"}


def test_export_refuses_a_config_that_no_longer_fits_its_weights(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("width: 4", "width: 8"))
    before = files_of(run)
    for command in ("export", "eval"):
        code, out = run_cli([command, str(run)], capsys)
        assert code == EXIT_CONFIG and "Traceback" not in out, out
        assert error_lines(out) == [f"bnexp: error: bnexp {command}: {config} no longer holds the settings "
                                    "checkpoint.pt was trained with (model.width: 4 there, 8 here; 'there' is the "
                                    "checkpoint): put back the run's config (summary.json holds it under \"config\")"]
    rewrite(run / checkpoint.FINAL, {"config": None})  # no record of its settings: the model is rebuilt to check
    code, out = run_cli(["export", str(run)], capsys)
    assert code == EXIT_CONFIG and error_lines(out) == [line for line in out.splitlines() if line], out
    assert f"bnexp export: {run / checkpoint.FINAL} with {config}: the weights do not fit the model its settings " \
        "describe (size mismatch for " in out
    assert {name for name in files_of(run)} == set(before)  # nothing written: no model.safetensors


@pytest.fixture
def unprivileged() -> Iterator[list[str]]:
    """The prefix that runs a command without root's power to write to read-only folders."""
    if os.geteuid() != 0:
        yield []
        return
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"]).returncode != 0:
        pytest.skip("running as root, and setpriv cannot drop CAP_DAC_OVERRIDE here: a read-only folder cannot stop "
                    "root's writes")
    yield prefix


@pytest.mark.slow
def test_read_only_run_folder_is_one_line(run: Path, unprivileged: list[str]) -> None:
    """A real read-only folder (root gives up the capability that ignores permissions)."""
    before = files_of(run)
    run.chmod(0o555)
    try:
        for command, then in (("eval", "make the folder writable"), ("export", "choose another file with out=PATH")):
            done = subprocess.run([*unprivileged, sys.executable, "-m", "bnexp", command, str(run)],
                                  capture_output=True, text=True)
            out = done.stdout + done.stderr
            assert done.returncode == EXIT_CONFIG and "Traceback" not in out, out
            assert error_lines(out) == [line for line in out.splitlines() if line]
            assert out.startswith(f"bnexp: error: bnexp {command}: cannot write ") and then in out
            assert f" {run} (PermissionError: Permission denied)" in out
    finally:
        run.chmod(0o755)
    assert files_of(run) == before


# Damaged JSON files bnexp wrote into a run folder: (the bytes, the part of the error that names the damage).
DAMAGED_JSON = {
    "not json": ('{"status": "compl', "JSONDecodeError: "),
    "binary": (b"\x80\x81\xfe\xff" * 8, "UnicodeDecodeError: "),
    "a list": ("[1, 2]", "a JSON list, not the object bnexp writes"),
    "nested too deep": ("[" * 200_000 + "]" * 200_000, "RecursionError: "),
}


def damage_json(path: Path, kind: str) -> None:
    text = DAMAGED_JSON[kind][0]
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)


def the_damage(path: Path, kind: str) -> str:
    return f"damaged {path.name} {path}: {DAMAGED_JSON[kind][1]}"


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``results/lrsearch`` after ``bnexp lrsearch *STUDY``: one finished candidate."""
    root = tmp_path_factory.mktemp("study")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        from bnexp.cli import main

        main(STUDY)
    return root


STUDY = ["lrsearch", *TINY, "methods=[none]", "acts=[relu]", "lrs=[1e-2]"]


@pytest.fixture
def candidate(study: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the study's results, the working directory where ``bnexp lrsearch *STUDY``
    finds them; the candidate's run folder."""
    shutil.copytree(study / "results", tmp_path / "results", dirs_exist_ok=True)  # beside a copy of the run
    monkeypatch.chdir(tmp_path)
    return Path("results", "lrsearch", "none", "relu", "lr=0.01,seed=0")


@pytest.mark.parametrize("kind", [k for k in DAMAGED_CONFIGS if k != "cut short"])
def test_study_run_with_a_damaged_config_is_one_line(kind: str, candidate: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``bnexp lrsearch`` (and ``hessian``, through the same code) meets a candidate whose
    config.yaml is damaged: one line naming the file, exit 2, the folder untouched."""
    config = candidate / "config.yaml"
    damage(config, kind)
    before = files_of(candidate)
    code, out = run_cli(STUDY, capsys)
    assert code == EXIT_CONFIG and "Traceback" not in out, out
    assert error_lines(out) == [line for line in out.splitlines() if line.startswith("bnexp:")]
    assert len(error_lines(out)) == 1 and DAMAGED_CONFIGS[kind][1].format(config) in out, out
    assert files_of(candidate) == before


DAMAGED_PROBES = {
    "not csv": ('step,probe\n"x\n', "ParserError: "),
    "a step that is a word": ("step,probe,layer,quantity,value\nabc,loss,all,loss,1.5\n",
                              "ValueError: invalid literal for int() with base 10: 'abc'"),
    "binary": (b"\x80\x81\xfe\xff", "UnicodeDecodeError: "),
    "other columns": ("a,b\n1,2\n", "no column step, probe, layer, quantity, value"),
    "empty": ("", "EmptyDataError: "),
}


@pytest.mark.parametrize("kind", DAMAGED_PROBES)
def test_study_run_with_damaged_probes_is_one_line(kind: str, candidate: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A finished candidate that ``bnexp lrsearch`` reuses, whose probes.csv (the loss probe
    the collapse rule reads) is damaged: one line naming the file, exit 2, nothing changed."""
    text, reason = DAMAGED_PROBES[kind]
    path = candidate / "probes.csv"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    before = files_of(candidate.parents[2])
    code, out = run_cli(STUDY, capsys)
    assert code == EXIT_CONFIG and "Traceback" not in out, out
    assert len(error_lines(out)) == 1 and f"bnexp: error: damaged probes.csv {path}: {reason}" in out, out
    assert files_of(candidate.parents[2]) == before


DATA_FILES_A_LIST = "its data_files is a list, not a mapping of file paths to their size and digest"
# A value of a summary.json replaced with another type: (key, value, the warning expected).
WRONG_TYPES = {
    "settings a list": ("config", ["model"], "its config is a JSON list, not a mapping of settings"),
    "final_top1 a word": ("final_top1", "abc", "its final_top1 is a JSON str, not a number"),
    "num_classes a bool": ("num_classes", True, "its num_classes is a JSON bool, not a whole number"),
    "data_files a list": ("data_files", ["x"], DATA_FILES_A_LIST),
    "a data_files entry a word": ("data_files", {"d.npz": "abc"}, "its data_files entry 'd.npz' is 'abc', not a "
                                  "mapping of a whole-number size and mtime_ns and an md5 or sha256 string"),
}


def wrong_type(path: Path, kind: str) -> str:
    key, value, reason = WRONG_TYPES[kind]
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    return reason


@pytest.mark.parametrize("kind", ["a list", "nested too deep", *WRONG_TYPES])
def test_run_with_a_damaged_summary_is_trained_again_with_a_warning(kind: str, run: Path, candidate: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A finished run's summary.json that parses as no summary, under the same ``bnexp
    train`` and ``bnexp lrsearch`` commands again: as an unreadable one, not a finished run,
    with a warning naming the file; the run trains again and writes a new summary."""
    for folder, command in ((run, ["train", *TINY]), (candidate, STUDY)):
        if kind in DAMAGED_JSON:
            damage_json(folder / "summary.json", kind)
            reason = DAMAGED_JSON[kind][1]
        else:
            reason = wrong_type(folder / "summary.json", kind)
        code, out = run_cli(command, capsys)
        assert code == 0 and "Traceback" not in out, out
        assert f"{folder / 'summary.json'}: {reason}" in out, out  # train names it in full
        assert "; not taken as a finished run" in out
        assert json.loads((folder / "summary.json").read_text())["status"] == "completed"


def test_checkpoint_with_a_damaged_data_record_is_not_resumed(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stopped run's periodic checkpoint whose record of the data files is a list (with a
    matching .sha256): the same command refuses to resume from it in one line naming the
    damage, exit 2, the checkpoint kept."""
    periodic = as_preempted(run)
    rewrite(periodic, {"data_files": ["x"]})
    before = files_of(run / checkpoint.CHECKPOINT_DIR)
    code, out = run_cli(["train", *TINY], capsys)
    assert code == EXIT_CONFIG and "Traceback" not in out, out
    assert error_lines(out) == [f"bnexp: error: {periodic.resolve()} was written by a run with other settings (the record of "
                                f"its data files is damaged: {DATA_FILES_A_LIST}): run with trainer.resume=never to "
                                "start over in this directory, or use another one"], out
    assert files_of(run / checkpoint.CHECKPOINT_DIR) == before


@pytest.mark.parametrize("kind", DAMAGED_JSON)
def test_eval_sets_a_damaged_eval_json_aside(kind: str, run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eval.json is bnexp's output: a damaged one does not stop a new evaluation; it is kept
    under the first free eval.json.damaged[-N], with a warning naming both."""
    path = run / "eval.json"
    kept = []
    for copy in ("eval.json.damaged", "eval.json.damaged-2"):
        damage_json(path, kind)
        kept.append(path.read_bytes())
        code, out = run_cli(["eval", str(run)], capsys)
        assert code == 0 and "Traceback" not in out, out
        assert f"bnexp: warning: {the_damage(path, kind)}" in out and f"; kept as {copy}, and a new eval.json " in out
        assert list(json.loads(path.read_text())) == ["synthetic/test"]
    assert [(run / name).read_bytes() for name in ("eval.json.damaged", "eval.json.damaged-2")] == kept


SUMMARY_DAMAGE = {**{kind: kind for kind in DAMAGED_JSON}, "num_classes a word": "num_classes 'ten'"}


@pytest.mark.parametrize("kind", SUMMARY_DAMAGE)
def test_export_of_a_run_with_a_damaged_summary_is_one_line(kind: str, run: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = run / "summary.json"
    if kind in DAMAGED_JSON:
        damage_json(path, kind)
        expected = the_damage(path, kind)
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), "num_classes": "ten"}))
        expected = f"damaged summary.json {path}: num_classes 'ten' is not a number of classes"
    before = files_of(run)
    code, out = run_cli(["export", str(run)], capsys)
    assert code == EXIT_CONFIG and "Traceback" not in out, out
    assert error_lines(out) == [line for line in out.splitlines() if line] and len(error_lines(out)) == 1, out
    assert expected in out
    assert files_of(run) == before


def test_binary_checksum_file_is_one_line_naming_the_checkpoint(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint.checksum_path(run / checkpoint.FINAL).write_bytes(b"\x80\x81\xfe\xff  checkpoint.pt\n")
    before = files_of(run)
    for command in ("eval", "export"):
        code, out = run_cli([command, str(run)], capsys)
        assert code == EXIT_CONFIG and "Traceback" not in out, out
        assert error_lines(out) == [line for line in out.splitlines() if line], out
        assert f"damaged checkpoint {run / checkpoint.FINAL}: its sha256 is " in out
        assert "its checksum file says \\x80\\x81\\xfe..." in out
    assert files_of(run) == before


def test_dry_run_lists_a_cell_with_a_damaged_summary_as_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    command = ["train", "-m", *TINY, "trainer.seed=0,1", "--dry-run"]
    code, out = run_cli(command, capsys)
    assert code == 0, out
    cell = Path(out.splitlines()[1].split()[0])
    cell.mkdir(parents=True)
    damage_json(cell / "summary.json", "a list")
    code, out = run_cli(command, capsys)
    assert code == 0 and "Traceback" not in out, out
    assert [line.split()[1] for line in out.splitlines()[1:3]] == ["[failed]", "[to"]


@pytest.mark.slow
def test_pack_refuses_a_checkpoint_that_would_run_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A pack of 2 in the default run directory, stopped at step 2 (as a preemption leaves
    it), whose second run's checkpoint would call exec (with its .sha256): the re-run refuses
    it in one line, exit 2; the code never runs and neither run's checkpoints change."""
    monkeypatch.chdir(tmp_path)
    command = ["train", *TINY, "trainer.pack=2"]
    assert run_cli(command, capsys)[0] == 0
    runs = sorted(Path("results", "runs").iterdir())  # each named as its own command names it: seed 0, then 1
    assert [r.name.endswith(",trainer.seed=1") for r in runs] == [False, True]
    periodic = [as_preempted(r) for r in runs]
    marker = tmp_path / "marker"
    rewrite(periodic[1], {"extra": RunsCode(marker)})
    before = [files_of(r / checkpoint.CHECKPOINT_DIR) for r in runs]
    code, out = run_cli(command, capsys)
    assert not marker.exists(), "the checkpoint's code ran"
    assert code == EXIT_CONFIG and "Traceback" not in out, out
    lines = error_lines(out)
    assert len(lines) == 1 and lines[0].startswith(f"bnexp: error: refused checkpoint {tmp_path / periodic[1]}: unpickling it "
                                                   "needs exec"), out
    assert [files_of(r / checkpoint.CHECKPOINT_DIR) for r in runs] == before


HESSIAN = ["hessian", "norms=[none]", "data=synthetic", "data.image_size=8", "data.train_size=64", "data.test_size=32",
           "model.width=4", "trainer.max_steps=2", "trainer.device=cpu", "probe.hessian.every=2"]


@pytest.mark.parametrize("file", ["config.yaml", "probes.csv"])
def test_hessian_run_with_a_damaged_file_is_one_line(file: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``bnexp hessian`` again over its finished run, whose config.yaml (not YAML) or
    probes.csv (binary) is damaged: one line naming the file, exit 2, nothing changed."""
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(HESSIAN, capsys)
    assert code == 0, out
    path = Path("results", "hessian", "none", file)
    if file == "config.yaml":
        damage(path, "not yaml")
        expected = DAMAGED_CONFIGS["not yaml"][1].format(path)
    else:
        path.write_bytes(DAMAGED_PROBES["binary"][0])
        expected = f"damaged probes.csv {path}: {DAMAGED_PROBES['binary'][1]}"
    before = files_of(Path("results"))
    code, out = run_cli(HESSIAN, capsys)
    assert code == EXIT_CONFIG and "Traceback" not in out, out
    assert len(error_lines(out)) == 1 and expected in out, out
    assert files_of(Path("results")) == before
