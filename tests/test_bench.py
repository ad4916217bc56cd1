"""``bnexp bench``: every subcommand runs at toy size and writes valid records (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bnexp.support.errors import EXIT_CONFIG
from tests.conftest import run_cli

QUICK = ["reps=2", "device=cpu"]
TOY_MODEL = ["model.width=4", "trainer.device=cpu"]
TOY_DATA = ["data=synthetic", "data.image_size=8", "data.train_size=64", "data.test_size=32", "data.num_workers=0"]
REQUIRED = {"name", "mode", "device", "seconds_median", "seconds_iqr", "reps", "baseline", "ratio", "env"}


def bench(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    out = tmp_path / f"{args[0]}.json"
    code, text = run_cli(["bench", *args, *QUICK, f"out={out}"], capsys)
    assert code == 0, text
    records = json.loads(out.read_text())
    for r in records:
        assert REQUIRED <= r.keys(), r.keys()
        assert r["mode"] in ("eager", "compiled") and r["device"] == "cpu" and r["seconds_median"] > 0
        assert r["env"]["torch"] and r["env"]["date"]
    assert "seconds_median" in text  # the printed table
    return records


def test_bench_norms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = bench(["norms", "nets=resnet20", "batch=2", "number=1", "warmup=1", "modes=eager"], tmp_path, capsys)
    # every registered layer by its short name, the baseline first (a plugin's would be there too)
    assert [r["name"] for r in records] == ["bn", "bn_4things", "bn_si", "brn", "cbn", "family", "gn", "ln", "popnorm"]
    assert all(r["baseline"] == "bn/eager" and r["ratio"] > 0 for r in records)


def test_bench_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["step", "models=resnet20", "norms=cbn,bnp", "batch=4", "image_size=8", "number=1", "warmup=1",
            "modes=eager", *TOY_MODEL]
    records = bench(args, tmp_path, capsys)
    assert {r["name"]: r["baseline"] for r in records} == {"cbn": "bn/eager", "bnp": "none/eager"}
    assert all(r["model"] == "resnet20" and r["ratio"] > 0 for r in records)


def test_bench_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = bench(["data", "batch=16", "train_size=64", "number=2", "warmup=1", "data.num_workers=0"], tmp_path,
                    capsys)
    by_name = {r["name"]: r for r in records}
    assert by_name.keys() == {"torch", "device", "torch-float32"} and by_name["torch"]["ratio"] == 1.0
    assert all(by_name[name]["images_per_s"] > 0 and by_name[name]["speedup"] > 0 for name in ("device", "torch-float32"))


def test_bench_graph(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU: today's step, the engine's and a bare loop (the graph cases need CUDA); a
    budget that holds no block expected to last as long as the one before leaves ``cbn`` out."""
    from bnexp.bench.common import Budget

    monkeypatch.setattr(Budget, "allows", lambda self, expected: expected == 0)
    out = tmp_path / "graph.json"
    code, text = run_cli(["bench", "graph", "norms=bn,cbn", "amps=off", "cases=eager,step,bare", "batch=8", "number=1",
                          "warmup=1", "epochs=1", "steps_per_epoch=5", "budget=60", *QUICK, f"out={out}", *TOY_MODEL,
                          *TOY_DATA], capsys)
    assert code == 0, text
    *records, skipped = json.loads(out.read_text())
    assert [r["mode"] for r in records] == ["eager", "step", "bare"]
    assert all(r["ms_per_step"] > 0 and r["projected_minutes"] > 0 and r["gpu_busy"] is None for r in records)
    assert records[0]["ratio"] == 1.0 and "images_per_s" in text
    assert (skipped["name"], skipped["amp"], skipped["mode"]) == ("cbn", "off", "left out (budget)")


def test_bench_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = bench(["run", "trainer.batch_size=16", *TOY_MODEL, *TOY_DATA], tmp_path, capsys)
    (run,) = records
    assert run["name"] == "run" and run["epochs"] == 2 and run["loader"] == "torch"
    assert run["extrapolated_seconds"] > run["seconds_median"] and run["ratio"] > 0


def test_bench_pack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["pack", "runs=1,3", "norm=cbn", "batch=4", "image_size=8", "number=1", "warmup=1", *TOY_MODEL]
    records = bench(args, tmp_path, capsys)
    assert [(r["name"], r["baseline"], r["runs"]) for r in records] == [("K=1", "1 x alone", 1), ("K=3", "3 x alone", 3)]
    for r in records:
        assert r["ratio"] > 0 and r["runs_per_hour"] > 0 and r["runs_per_hour_alone"] > 0
        assert r["runs_per_hour"] == pytest.approx(r["runs"] * 3600 / (120 * 391 * r["seconds_median"]))


def test_bench_run_of_a_pack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run,) = bench(["run", "reps=1", "trainer.batch_size=16", "trainer.pack=2", *TOY_MODEL, *TOY_DATA], tmp_path,
                   capsys)
    assert run["name"] == "run x2 (packed)" and run["extrapolated_seconds"] > run["seconds_median"]


@pytest.mark.parametrize("args, message", [
    (["warp"], "unknown bench subcommand 'warp'"),
    (["norms", "model.width=4"], "unknown option 'model.width'"),
    (["norms", "reps=many"], "reps='many' is not valid"),
    (["norms", "reps=0"], "reps=0 is not valid: reps must be an integer >= 1"),
    (["step", "warmup=-1"], "warmup=-1 is not valid: warmup must be an integer >= 0"),
    (["norms", "nets=resnet9"], "unknown net 'resnet9'"),
    (["run", "trainer.epochs=1"], "bench run needs trainer.epochs >= 2"),
    (["run", "warmup=1"], "Could not override 'warmup'"),
])
def test_bench_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run_cli(["bench", *args], capsys)
    assert code == EXIT_CONFIG and message in text


@pytest.mark.slow  # DataLoader workers started four times
def test_bench_imagenet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = bench(["imagenet", "classes=2", "per_class=3", "batch=4", "workers=1", "gpu_workers=1", "compare=4",
                     "augs=cbn", "model_batches="], tmp_path, capsys)
    by_name = {r["name"]: r for r in records}
    assert list(by_name) == ["pixels/cbn", "device/cbn", "gpu/cbn/w1", "cpu/cbn/w1"]
    assert by_name["pixels/cbn"]["max_levels"] <= 2 and by_name["pixels/cbn"]["images"] == 4  # RESIZER_LEVELS
    assert 0 <= by_name["pixels/cbn"]["differing"] < 0.1
    assert all(r["images_per_s"] > 0 and r["ratio"] is None for r in records[1:])  # no model measured
    row = (tmp_path / "imagenet.md").read_text()
    assert row.startswith("| 20") and "gpu/cbn/w1" in row and row.count("\n") == 1


TABLE1_IMAGES = 1350 * 120 * 391 * 128  # CBN Table 1: runs x epochs x steps of 128 per CIFAR-10 epoch x batch


def test_bench_table_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every K x form at the first setup, the largest K at the other, one worker: images/s
    from the step, Table 1's GPU-hours from its 1,350 runs of 120 epochs, the best named,
    and the markdown row beside the JSON."""
    args = ["table_cost", "runs=1,2", "convs=grouped,streams", "workers=1", "setups=off:contiguous,off:channels_last",
            "batch=4", "image_size=8", "warmup=1", *TOY_MODEL]
    records = bench(args, tmp_path, capsys)
    assert [r["name"] for r in records] == [
        "K=1 grouped x1 off contiguous", "K=1 streams x1 off contiguous", "K=2 grouped x1 off contiguous",
        "K=2 streams x1 off contiguous", "K=2 grouped x1 off channels_last", "K=2 streams x1 off channels_last"]
    for r in records:
        assert r["images_per_second"] == pytest.approx(r["runs"] * 4 / r["seconds_median"])
        assert r["table1_gpu_hours"] == pytest.approx(TABLE1_IMAGES / r["images_per_second"] / 3600)
    best = max(records, key=lambda r: r["images_per_second"])
    assert [r["best"] for r in records] == [r is best for r in records] and best["ratio"] == 1
    row = (tmp_path / "table_cost.md").read_text().splitlines()[2]
    assert f"| {best['name']} | {best['images_per_second']:,.0f} | {best['table1_gpu_hours']:.2f} |" in row



@pytest.mark.slow  # two worker processes, each importing torch
def test_bench_table_cost_with_two_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two worker processes step at once: images/s counts both workers' runs."""
    args = ["table_cost", "runs=2", "convs=streams", "workers=2", "setups=off:contiguous", "batch=4", "image_size=8",
            "warmup=1", *TOY_MODEL]
    [r] = bench(args, tmp_path, capsys)
    assert r["name"] == "K=2 streams x2 off contiguous" and r["error"] is None
    assert r["images_per_second"] == pytest.approx(2 * 2 * 4 / r["seconds_median"])

def test_table_cost_writes_as_it_goes_and_starts_nothing_its_budget_cannot_hold(tmp_path: Path, monkeypatch) -> None:
    """On a clock the measurements move (a grouped setting takes 10 s per run, a streams one
    20 s): each setting starts only when the seconds left hold what the last of its form took
    per run (the slowest form's before its own), the JSON on disk holds every setting measured
    before the next starts, and the row names the faster form per setup."""
    from types import SimpleNamespace

    from bnexp.bench import table_cost
    from bnexp.bench.common import parse

    out = tmp_path / "table_cost.json"
    clock = [0.0]
    on_disk: list[list[str]] = []

    class Workers:
        def __init__(self, *args: object) -> None:
            pass

        def measure(self, setting: table_cost.Setting) -> list[list[float]]:
            on_disk.append([r["name"] for r in json.loads(out.read_text())] if out.exists() else [])
            clock[0] += setting.runs * (10 if setting.conv == "grouped" else 20)
            return [[0.5 if setting.conv == "grouped" else 0.25]]

        def close(self) -> None:
            pass

    monkeypatch.setattr(table_cost, "Workers", Workers)
    monkeypatch.setattr(table_cost, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(table_cost, "table_images", lambda: 10**6)
    options, _ = parse(["runs=1,2,4", "workers=1", "setups=off:contiguous", "batch=4", "budget=60", "device=cpu",
                        f"out={out}"], table_cost.DEFAULTS, overrides_ok=True)
    records = table_cost.bench(options, [])
    measured = ["K=1 grouped x1 off contiguous", "K=1 streams x1 off contiguous", "K=2 grouped x1 off contiguous"]
    assert [r["name"] for r in records[:-1]] == measured and clock[0] == 50  # 10 + 20 + 2 x 10
    assert records[-1]["left_out"] == ["K=2 streams x1 off contiguous", "K=4 grouped x1 off contiguous",
                                       "K=4 streams x1 off contiguous"]
    assert on_disk == [[], measured[:1], measured[:2]]
    assert [r["name"] for r in json.loads(out.read_text())] == [*measured, "left out (budget)"]
    row = out.with_suffix(".md").read_text()
    assert "off contiguous: streams faster (streams / grouped images/s, median of 1: 2.00)" in row
    assert "left out (budget): K=2 streams x1 off contiguous, K=4 grouped" in row
