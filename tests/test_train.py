"""End-to-end runs of `bnexp train` on synthetic data and on a tiny CIFAR-format folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, read_metrics, read_summary, run_cli, run_dir_of, write_cifar10

SMALL = [o for o in TINY if not o.startswith("trainer.max_steps")]


def test_short_run_learns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", *SMALL, "trainer.max_steps=30", "trainer.eval_every=10", "trainer.eval_unit=step",
            "data.train_size=512", "data.test_size=256", "data.image_size=16", "trainer.batch_size=32",
            "model.width=8", "schedule=constant", "optim.lr=0.01", "data.noise=20", *run_dir_of(tmp_path)]
    code, out = run_cli(args, capsys)
    assert code == 0, out
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [10, 20, 30]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed"
    assert float(rows[-1]["train_acc"]) > 25.0 and summary["final_top1"] > 20.0  # chance is 10%
    assert summary["params"] > 0 and summary["steps"] == 30 and "final_top5" in summary
    for name in ("config.yaml", "checkpoint.pt", "summary.json"):
        assert (tmp_path / "run" / name).is_file()


def test_same_seed_same_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for name in ("a", "b"):
        args = ["train", *TINY, "trainer.max_steps=6", "trainer.eval_every=3", "trainer.eval_unit=step",
                f"hydra.run.dir={tmp_path / name}"]
        assert run_cli(args, capsys)[0] == 0
        rows = read_metrics(tmp_path / name / "metrics.csv")
        runs.append([{k: v for k, v in r.items() if k != "seconds"} for r in rows])
    assert runs[0] == runs[1] and len(runs[0]) == 2


def test_different_seed_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    losses = []
    for seed in (0, 1):
        args = ["train", *TINY, f"trainer.seed={seed}", f"hydra.run.dir={tmp_path / str(seed)}"]
        assert run_cli(args, capsys)[0] == 0
        losses.append(read_metrics(tmp_path / str(seed) / "metrics.csv")[-1]["train_loss"])
    assert losses[0] != losses[1]


def test_multirun_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["train", "-m", *TINY, "act=relu,tanh", *run_dir_of(tmp_path)], capsys)
    assert code == 0, out
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    assert {s.parent.name.split(",")[0] for s in summaries} == {"act=relu", "act=tanh"}


def test_real_cifar_loader_reads_tiny_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_cifar10(tmp_path / "data")
    args = ["train", "data=cifar10", f"data.root={tmp_path / 'data'}", "data.download=false", "data.verify=false",
            "data.num_workers=0", "model.width=4", "trainer.batch_size=25", "trainer.max_steps=2",
            "trainer.device=cpu", *run_dir_of(tmp_path)]
    code, out = run_cli(args, capsys)
    assert code == 0, out
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["steps_per_epoch"] == 4  # 100 images / 25


def test_cifar_loader_arrays(tmp_path: Path) -> None:
    import pickle

    import numpy as np

    from bnexp.data.cifar import load_cifar

    folder = write_cifar10(tmp_path)
    data = load_cifar({"name": "cifar10", "root": str(tmp_path), "download": False, "verify": False})
    with open(folder / "data_batch_1", "rb") as f:
        first = pickle.load(f)
    assert data.x_train.shape == (100, 3, 32, 32) and data.x_test.shape == (20, 3, 32, 32)
    expected = np.asarray(first["data"][0]).reshape(3, 32, 32)
    assert (data.x_train[0].numpy() == expected).all()
    assert data.y_train[:20].tolist() == first["labels"]
    assert data.num_classes == 10


def test_truncated_cifar_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_cifar10(tmp_path / "data")
    path = folder / "data_batch_3"
    path.write_bytes(path.read_bytes()[:500])
    args = ["train", "data=cifar10", f"data.root={tmp_path / 'data'}", "data.download=false", "data.verify=false",
            *run_dir_of(tmp_path)]
    code, out = run_cli(args, capsys)
    assert code == 2
    assert "corrupt or truncated data file" in out and str(path) in out


def test_checksum_mismatch_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_cifar10(tmp_path / "data")
    args = ["train", "data=cifar10", f"data.root={tmp_path / 'data'}", "data.download=false", *run_dir_of(tmp_path)]
    code, out = run_cli(args, capsys)
    assert code == 2 and "md5 checksum" in out and str(folder / "data_batch_1") in out


def test_offline_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "data=cifar10", f"data.root={tmp_path / 'nothing'}", "data.download=false", *run_dir_of(tmp_path)]
    code, out = run_cli(args, capsys)
    assert code == 3
    for part in (str(tmp_path / "nothing" / "cifar-10-batches-py"), "data.root=", "data.download=", "data=synthetic"):
        assert part in out
    assert read_summary(tmp_path / "run")["status"] == "failed"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lr=0", "optim.lr=0 is not valid"),
        ("optim.lr=-0.1", "optim.lr=-0.1 is not valid"),
        ("trainer.batch_size=0", "trainer.batch_size=0 is not valid"),
        ("trainer.epochs=-1", "trainer.epochs=-1 is not valid"),
        ("norm.placement=middle", "valid choices: after_op, before_op"),
        ("trainer.device=tpu", "valid choices: auto, cpu, cuda"),
        ("data.sampling=sometimes", "valid choices: shuffle, with_replacement"),
        # nothing changed or ignored without a word (TINY: 64 training images, width 4)
        ("optim.lr=inf", "optim.lr=inf is not valid: optim.lr must be a number > 0"),
        ("optim.weight_decay=nan", "optim.weight_decay=nan is not valid"),
        ("trainer.batch_size=100", "trainer.batch_size=100 is larger than the 64 training images: use "
                                   "trainer.batch_size <= 64"),
        ("trainer.batch_size=100 data.sampling=shuffle", "trainer.batch_size=100 is larger than the 64 training "
                                                         "images: use trainer.batch_size <= 64"),
        ("norm=gn norm.groups=3", "norm.groups=3 does not divide the 4 channels of a normalized layer of "
                                  "model=resnet20: norm.groups must divide the channels of every normalized layer "
                                  "(the input images excepted); valid here: 1, 2, 4"),
        ("norm=gn norm.groups=0", "norm.groups=0 is not valid: norm.groups must be an integer in [1, 65536]"),
        ("schedule.milestones=abc", "schedule.milestones='abc' is not valid: schedule.milestones must be a list"),
        ("schedule.milestones=[100,60]", "in strictly increasing order"),
        ("model.width=0", "model.width=0 is not valid: model.width must be an integer in [1, 65536]"),
        ("trainer.dist_timeout=0", "trainer.dist_timeout=0 is not valid: trainer.dist_timeout must be a number in (0, 604800]"),
        ("trainer.resume=nevr", "trainer.resume='nevr' is not valid: use auto (continue from the newest checkpoint "
                                "in the run directory), never (start over), or the path of a checkpoint file"),
        ("+trainer.epoch=3", "unknown key 'trainer.epoch' (bnexp would ignore it; only tags.* may be added with +); "
                             "did you mean trainer.epochs?"),
        ("trainer.epoch=3", "unknown key 'trainer.epoch'; did you mean trainer.epochs?"),
        ("nrom=cbn", "unknown config group or key 'nrom'; did you mean norm?"),
        ("cbn_row=r1", "config group 'cbn_row' is not in this config's defaults, so cbn_row=... has nothing to "
                       "replace: +cbn_row=OPTION adds it (options: r1, r2, r3, r4, r5, r6, r7)"),
        ("norm=bn,cbn", "norm=bn,cbn gives several values: add -m to run one job per value"),
        ("norm=bnp norm.placement=before_op", "norm.placement=before_op means nothing here: norm=bnp has no "
                                              "normalization layers; leave it out"),
        ("norm=gn norm.sync=true", "norm.sync=True means nothing here: norm=gn uses no batch statistics"),
        ("norm=bn norm.join=before_act", "norm.join=before_act means nothing here: it applies to "
                                         "norm.placement=before_op only"),
        ("norm=bn norm.amat_eta=0.9", "norm.amat_eta=0.9 means nothing here: it applies with norm.amat=true only"),
        ("optim=adam optim.beta2=1", "optim.beta2=1 is not valid: optim.beta2 must be a number in [0, 1)"),
        ("optim=adam optim.eps=0", "optim.eps=0 is not valid: optim.eps must be a number > 0"),
        ("experiment=popnorm/table1 optim=adam", "optim.momentum=0.9 means nothing with optim=adam (optim.beta1 is its "
                                                 "momentum): set optim.momentum=0"),
        ("optim=adam optim.momentum=0.9", "unknown key 'optim.momentum' Valid keys under optim: beta1, beta2, eps,"),
        ("norm=bn_4things norm.groups=3", "norm.groups=3 does not divide the 4 channels of a normalized layer of "
                                          "model=resnet20"),
        ("norm=bn_4things norm.ghost_batch=0", "norm.ghost_batch=0 is not valid: norm.ghost_batch must be an integer "
                                               "in [1, 1048576] (or null)"),
        ("norm=bn_4things norm.alpha=2", "norm.alpha=2 is not valid: norm.alpha must be a number in [0, 1]"),
        ("norm=bn_4things trainer.batch_size=1", "or bn_4things with norm.groups set"),
    ],
)
def test_bad_values(tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, expected: str) -> None:
    """One message naming the value and what is valid, exit code 2, no traceback."""
    code, out = run_cli(["train", *TINY, *override.split(), *run_dir_of(tmp_path)], capsys)
    assert code == 2, out
    assert expected in out and "Traceback" not in out and out.count("\n") == 1, out


@pytest.mark.parametrize(("group", "valid"), [("model", "resnet20"), ("norm", "bn"), ("act", "relu"), ("data", "synthetic"),
                                              ("experiment", "cbn/table1"), ("hydra/launcher", "joblib")])
def test_unknown_group_member(tmp_path: Path, capsys: pytest.CaptureFixture[str], group: str, valid: str) -> None:
    """Hydra's page about a missing config becomes one line listing the options, exit code 2."""
    code, out = run_cli(["train", f"{group}=nonsense", *run_dir_of(tmp_path)], capsys)
    assert code == 2
    assert out.startswith(f"bnexp: error: unknown {group} 'nonsense'; valid choices: ") and valid in out
    assert out.count("\n") == 1, out


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["trian"], capsys)
    assert code == 2 and "valid commands" in out and "train" in out
