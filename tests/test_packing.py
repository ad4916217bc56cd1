"""Packed runs (trainer.pack): K seeds trained as one model compute what K runs alone compute."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from bnexp.data import build_data
from bnexp.data.loaders import build_loaders, build_seeded_loaders
from bnexp.engine import checkpoint
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import TrainState
from bnexp.engine.method_hooks import AmatLearningRate, WeightNormLog, method_callbacks
from bnexp.engine.optim import build_optimizer, build_schedule
from bnexp.engine.preemption import Preempted
from bnexp.engine.trainer import evaluate, train_step
from bnexp.models import DataSpec, build_model
from bnexp.models.packing import pack_inputs, pack_models, pack_state, packed_losses, unpack_state
from bnexp.nn import BNP, NormFamily
from bnexp.nn.packed import PackedLinear
from bnexp.support.errors import EXIT_PREEMPTED
from bnexp.support.runinfo import seed_everything
from tests import warm
from tests.conftest import QUICK_PRESET, TINY, compose_cfg, copy_runs, read_metrics, read_summary, run_cli
from tests.test_resilience import assert_same_run, cli_command, wait_for_checkpoint

CPU = torch.device("cpu")
RUNS = 3
STEPS = 20
# 20 steps with momentum and weight decay, a 3-step linear warmup, the lr divided by 10
# after step 10: AMAT's adaptive eta = 1 - 10 lr goes from 0.95 down to 0.5, then 0.95.
PROTOCOL = ["optim.lr=0.05", "optim.momentum=0.9", "optim.weight_decay=5e-4", "schedule.unit=step",
            "schedule.milestones=[10]", "schedule.warmup=3", "schedule.warmup_mode=linear", "trainer.device=cpu"]
MODELS = {  # (overrides, image size, batch)
    "resnet20": (["model=resnet20", "model.width=4"], 8, 8),
    "vgg16": (["model=vgg16", "model.width=4"], 32, 6),
    "mlp3x100": (["model=mlp3x100", "model.width=12"], 6, 8),
}
# Gradients, momentum and the AMAT/BNP statistics are all per element: a pack and its runs
# alone differ by the rounding of grouped against plain kernels only. After 20 steps that is
# below 1e-10, unless training itself amplifies rounding beyond it: VGG-16 with before_op
# POP-Norm or CBN at width 4 moves by 6e-10 and 1e-6 when the values of its first batch
# change by one ulp. There the pack must stay within 10 times that sensitivity of the run
# (:func:`assert_same_to_rounding`). Only the pairs named below may use that bound; every
# other pair is held to the plain tolerance.
TOL = 1e-10
ULP_MARGIN = 10.0
SENSITIVE_20_STEPS = {("vgg16", "popnorm"), ("vgg16", "cbn")}
SENSITIVE_2_STEPS = {("resnet50", "bn"), ("efficientnet_b0", "bn")}  # relative 1e-12 missed by 3.5e-9, 2.5e-10


def batches(run: int, size: int, batch: int, classes: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``run``'s own 20 training batches in float64 (not shared with the other runs)."""
    g = torch.Generator().manual_seed(1000 + run)
    return [(torch.randn(batch, 3, size, size, generator=g, dtype=torch.float64) * 2 + 0.5,
             torch.randint(classes, (batch,), generator=g)) for _ in range(STEPS)]


def trainer_parts(cfg, model: nn.Module, tmp_path: Path):
    """The trainer's optimizer, schedule and method hooks (AMAT lr, BNP) for ``model``."""
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, steps_per_epoch=STEPS)
    state = TrainState(cfg, tmp_path, CPU, model, optimizer, scheduler, STEPS, STEPS)
    callbacks = [cb for cb in method_callbacks(cfg) if not isinstance(cb, WeightNormLog)]
    for cb in callbacks:
        cb.on_train_start(state)
    return AmpCompileWrapper(model, CPU), state, callbacks


def train(cfg, model: nn.Module, data: list, tmp_path: Path, criterion) -> tuple[nn.Module, dict]:
    """20 real training steps of ``model`` on ``data``; the model and the optimizer/BNP state."""
    net, state, callbacks = trainer_parts(cfg, model, tmp_path)
    for x, y in data:
        train_step(net, state.optimizer, callbacks, state, x, y, criterion)
        state.scheduler.step()
        state.step += 1
    extra = {"optimizer": state.optimizer.state_dict()["state"],
             "callbacks": {type(cb).__name__: cb.state_dict() for cb in callbacks}}
    return model, extra


def seeded(cfg, spec: DataSpec, seed: int) -> nn.Module:
    seed_everything(seed)
    return build_model(cfg.model, cfg.norm, cfg.act.name, spec).double()


def assert_same_to_rounding(difference: float, floor: float, cfg, spec: DataSpec, run: int, data: list,
                            alone: nn.Module, tmp_path: Path, sensitive: set[tuple[str, str]],
                            relative: bool = False) -> None:
    """``difference`` (run ``run`` of a pack against ``alone``, trained on ``data``) is below
    ``floor``, or, for a (model, norm) pair in ``sensitive`` only, below :data:`ULP_MARGIN` times
    what moving every value of the first batch by one ulp changes in the run alone (training
    that amplifies rounding beyond ``floor``)."""
    if difference < floor:
        return
    assert (cfg.model.name, cfg.norm.name) in sensitive, (cfg.model.name, cfg.norm.name, run, difference, floor)
    x = torch.nextafter(data[0][0], torch.tensor(float("inf"), dtype=data[0][0].dtype))
    nudged, _ = train(cfg, seeded(cfg, spec, run), [(x, data[0][1]), *data[1:]], tmp_path,
                      nn.functional.cross_entropy)
    sensitivity = max_difference(nudged.state_dict(), alone.state_dict(), relative)
    assert difference < ULP_MARGIN * sensitivity, (run, difference, sensitivity)


def max_difference(a, b, relative: bool = False) -> float:
    """Largest absolute difference between two nested states of tensors; ``relative``: each
    tensor's difference divided by its largest magnitude (at least 1)."""
    if isinstance(a, torch.Tensor):
        if not a.numel():
            return 0.0
        scale = b.double().abs().max().clamp(min=1.0).item() if relative else 1.0
        return (a.double() - b.double()).abs().max().item() / scale
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max([max_difference(a[k], b[k], relative) for k in a] or [0.0])
    assert a == b
    return 0.0


@pytest.mark.parametrize("model,norm", [(m, n) for m in ("resnet20", "vgg16") for n in ("bn", "popnorm", "cbn", "bnp")]
                         + [("mlp3x100", n) for n in ("bn", "popnorm", "cbn", "bnp")])
def test_pack_equals_runs_alone_in_float64(model: str, norm: str, tmp_path: Path) -> None:
    overrides, size, batch = MODELS[model]
    cfg = compose_cfg([*overrides, f"norm={norm}", *PROTOCOL])
    spec = DataSpec(10, 3, size)
    data = [batches(run, size, batch) for run in range(RUNS)]
    alone = [train(cfg, seeded(cfg, spec, run), data[run], tmp_path, nn.functional.cross_entropy)
             for run in range(RUNS)]
    packed = pack_models([seeded(cfg, spec, run) for run in range(RUNS)])
    joined = [(pack_inputs([data[r][s][0] for r in range(RUNS)]), torch.stack([data[r][s][1] for r in range(RUNS)], 1))
              for s in range(STEPS)]
    packed, extra = train(cfg, packed, joined, tmp_path, packed_losses)
    x = torch.randn(5, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits = packed.eval()(pack_inputs([x] * RUNS)).view(5, RUNS, -1)

    for run, (model_alone, extra_alone) in enumerate(alone):
        difference = max(max_difference(unpack_state(packed.state_dict(), RUNS)[run], model_alone.state_dict()),
                         max_difference(unpack_state(extra, RUNS)[run], extra_alone),
                         (logits[:, run] - model_alone.eval()(x)).abs().max().item())
        assert_same_to_rounding(difference, TOL, cfg, spec, run, data[run], model_alone, tmp_path, SENSITIVE_20_STEPS)
    if norm == "cbn":  # the last steps ran at lr 0.005 (eta 0.95), after steps at eta 0.5
        etas = [m.amat_eta_now.item() for m in packed.modules() if isinstance(m, NormFamily) and m.amat]
        assert etas and all(abs(eta - 0.95) < 1e-12 for eta in etas)


@pytest.mark.parametrize("model,norm", [("vgg16", "popnorm"), ("vgg16", "cbn"),
                                        ("vgg16", "popnorm norm.scale=false norm.rho=1.0 norm.gamma=false")])
def test_pack_equals_runs_alone_after_one_step(model: str, norm: str, tmp_path: Path) -> None:
    """Where 20 steps amplify rounding beyond 1e-10, one step is exact to rounding (POP-Norm's
    mean removal alone too, whose constant gamma is a buffer outside the state)."""
    overrides, size, batch = MODELS[model]
    cfg = compose_cfg([*overrides, *f"norm={norm}".split(), *PROTOCOL])
    spec = DataSpec(10, 3, size)
    data = [batches(run, size, batch)[:1] for run in range(RUNS)]
    packed = pack_models([seeded(cfg, spec, run) for run in range(RUNS)])
    joined = [(pack_inputs([d[0][0] for d in data]), torch.stack([d[0][1] for d in data], 1))]
    packed, _ = train(cfg, packed, joined, tmp_path, packed_losses)
    for run in range(RUNS):
        alone, _ = train(cfg, seeded(cfg, spec, run), data[run], tmp_path, nn.functional.cross_entropy)
        assert max_difference(unpack_state(packed.state_dict(), RUNS)[run], alone.state_dict()) < 1e-14


def test_state_round_trip_and_single_model_load(tmp_path: Path) -> None:
    """A run's state taken out of a trained pack loads into the plain model (strict keys and
    shapes) and evaluates as that run of the pack does."""
    cfg = compose_cfg(["model=resnet20", "model.width=4", "norm=cbn", *PROTOCOL])
    spec = DataSpec(10, 3, 8)
    models = [seeded(cfg, spec, run) for run in range(RUNS)]
    packed = pack_models(models)
    assert max_difference(pack_state([m.state_dict() for m in models]), packed.state_dict()) == 0.0
    data = [batches(run, 8, 8)[:5] for run in range(RUNS)]
    joined = [(pack_inputs([d[s][0] for d in data]), torch.stack([d[s][1] for d in data], 1)) for s in range(5)]
    packed, _ = train(cfg, packed, joined, tmp_path, packed_losses)
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    logits = packed.eval()(pack_inputs([x] * RUNS)).view(6, RUNS, -1)
    for run, part in enumerate(unpack_state(packed.state_dict(), RUNS)):
        plain = seeded(cfg, spec, 99)
        plain.load_state_dict(part)
        assert (plain.eval()(x) - logits[:, run]).abs().max() < 1e-12


def test_packed_linear_is_k_linears() -> None:
    layers = [nn.Linear(4, 3).double() for _ in range(RUNS)]
    packed = PackedLinear(RUNS, 4, 3).double()
    packed.load_state_dict(pack_state([m.state_dict() for m in layers]))
    x = [torch.randn(5, 4, dtype=torch.float64) for _ in range(RUNS)]
    out = packed(torch.cat(x, 1))
    expected = torch.cat([m(v) for m, v in zip(layers, x)], 1)
    assert (out - expected).abs().max() < 1e-14
    torch.autograd.gradcheck(packed, (torch.cat(x, 1).requires_grad_(),))


def test_bnp_regularizer_is_per_run() -> None:
    """BNP's eps1 * max(sigma2) takes the max over one run's inputs, not the whole pack's."""
    layers = [nn.Linear(4, 2).double() for _ in range(2)]
    packed = PackedLinear(2, 4, 2).double()
    alone = [BNP(m, rho=0.0) for m in layers]
    together = BNP(packed, rho=0.0)
    x = [torch.randn(6, 4, dtype=torch.float64) * scale for scale in (1.0, 50.0)]
    for m, v in zip(layers, x):
        m(v)
    packed(torch.cat(x, 1))
    layer = next(together.layers())
    expected = torch.cat([next(b.layers()).s2() for b in alone])
    assert (layer.s2() - expected).abs().max() < 1e-12


def test_unpackable_model_says_so() -> None:
    from bnexp.support.errors import ConfigError

    cfg = compose_cfg(["model=efficientnet_b0"])
    models = [build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 32)) for _ in range(2)]
    with pytest.raises(ConfigError, match=r"StochasticDepth, p=.* draws random masks"):
        pack_models(models)


@pytest.mark.parametrize("loader", ["torch", "device"])
def test_packed_loader_yields_each_runs_own_images(loader: str, tmp_path: Path) -> None:
    """Run k's batches in a pack (its own sampler and augmentation draws, under its own
    random state on the DataLoader path, its own generators on the device path) are exactly
    those of run k alone, augmentation included."""
    cfg = compose_cfg([*TINY, "data.augment=true", "trainer.max_steps=9", f"data.loader={loader}"])
    bundle = build_data(cfg.data)
    from bnexp.engine.pack import PackMember

    def alone(seed: int) -> list[torch.Tensor]:
        seed_everything(seed)
        torch.rand(7)  # stands for the model's initialization
        stream = build_loaders(bundle, cfg.data, 16, seed, False).epochs_from(0)
        return [torch.cat([x.flatten(), y.float()]) for x, y in (next(stream) for _ in range(9))]

    expected = [alone(seed) for seed in range(RUNS)]
    members = []
    for seed in range(RUNS):
        seed_everything(seed)
        torch.rand(7)
        m = PackMember(seed, cfg, tmp_path / str(seed), {}, rng=checkpoint.capture_rng())
        m.stream = build_loaders(bundle, cfg.data, 16, seed, False).epochs_from(0)
        members.append(m)
    seed_everything(123)  # the pack's own state is another one
    got = [[] for _ in range(RUNS)]
    for _ in range(9):
        for m in members:
            x, y = m.next_batch(swap_rng=loader == "torch")
            got[m.index].append(torch.cat([x.flatten(), y.float()]))
    for run in range(RUNS):
        assert all(torch.equal(a, b) for a, b in zip(got[run], expected[run]))
    assert not torch.equal(got[0][0], got[1][0])


def test_evaluate_reports_each_run(tmp_path: Path) -> None:
    cfg = compose_cfg(["model=resnet20", "model.width=4", "norm=bn"])
    spec = DataSpec(10, 3, 8)
    models = [seeded(cfg, spec, run).float() for run in range(RUNS)]
    data = [(torch.randn(7, 3, 8, 8), torch.randint(10, (7,))) for _ in range(2)]
    packed = evaluate(pack_models(models), data, CPU, 10, RUNS)
    for run, model in enumerate(models):
        alone = evaluate(model, data, CPU, 10)[0]
        assert packed[run]["test_acc"] == alone["test_acc"]
        assert abs(packed[run]["test_loss"] - alone["test_loss"]) < 1e-5


PACK_RUN = [*TINY, "norm=cbn", "trainer.max_steps=6", "trainer.eval_every=3", "trainer.eval_unit=step",
            "trainer.log_every=1"]


def run_pack(tmp_path: Path, capsys, extra: list[str] = ()) -> int:
    code, _ = run_cli(["train", *PACK_RUN, "trainer.pack=3", f"hydra.run.dir={tmp_path / 'run'}", *extra], capsys)
    return code


def test_pack_writes_each_run_as_alone(tmp_path: Path, capsys) -> None:
    assert run_pack(tmp_path, capsys) == 0
    dirs = [tmp_path / "run", tmp_path / "run-seed1", tmp_path / "run-seed2"]
    for seed, run_dir in enumerate(dirs):
        summary = read_summary(run_dir)
        assert summary["status"] == "completed" and summary["config"]["trainer"]["seed"] == seed
        assert sorted(summary["packed_with"]) == sorted(str(d) for d in dirs if d != run_dir)
        assert (run_dir / "config.yaml").is_file() and (run_dir / ".hydra" / "overrides.yaml").is_file()
        payload = torch.load(run_dir / "checkpoint.pt", weights_only=False)
        cfg = compose_cfg(PACK_RUN)
        model = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 8))
        model.load_state_dict(payload["model"])  # a plain model takes a run's weights from a pack
        assert payload["step"] == 6 and payload["config"]["trainer"] == {**summary["config"]["trainer"]}
        assert summary["config"]["trainer"]["pack"] == 1  # written as its own command would run it
        assert "trainer.pack=3" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
        test = torch.utils.data.DataLoader(build_data(cfg.data).test, batch_size=500)
        final = read_metrics(run_dir / "metrics.csv")[-1]
        plain = evaluate(model, test, CPU, 10)[0]  # and evaluates as the pack evaluated it
        assert plain["test_acc"] == float(final["test_acc"])
        assert abs(plain["test_loss"] - float(final["test_loss"])) < 1e-5 * abs(plain["test_loss"])
    # each run alone: the same metrics to float32 rounding (grouped and plain kernels differ)
    code, _ = run_cli(["train", *PACK_RUN, "trainer.seed=1", f"hydra.run.dir={tmp_path / 'alone'}"], capsys)
    assert code == 0
    packed, alone = read_metrics(dirs[1] / "metrics.csv"), read_metrics(tmp_path / "alone" / "metrics.csv")
    assert [r["step"] for r in packed] == [r["step"] for r in alone]
    for a, b in zip(packed, alone):
        assert float(a["train_acc"]) == float(b["train_acc"])
        assert abs(float(a["train_loss"]) - float(b["train_loss"])) < 1e-4 * abs(float(b["train_loss"]))
    # a re-run finds the finished runs and trains nothing
    before = [(d / "summary.json").read_text() for d in dirs]
    assert run_pack(tmp_path, capsys) == 0
    assert [(d / "summary.json").read_text() for d in dirs] == before


def test_rerun_packs_only_missing_runs(tmp_path: Path, capsys) -> None:
    code, _ = run_cli(["train", *PACK_RUN, "trainer.seed=1", f"hydra.run.dir={tmp_path / 'run-seed1'}"], capsys)
    assert code == 0
    before = (tmp_path / "run-seed1" / "summary.json").read_text()
    assert run_pack(tmp_path, capsys) == 0
    assert (tmp_path / "run-seed1" / "summary.json").read_text() == before  # skipped, not retrained
    for run_dir in (tmp_path / "run", tmp_path / "run-seed2"):
        summary = read_summary(run_dir)
        assert summary["status"] == "completed"
        assert summary["packed_with"] == [str(d) for d in (tmp_path / "run", tmp_path / "run-seed2") if d != run_dir]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_nan_in_one_run_leaves_the_others_bit_identical(layout: str, tmp_path: Path, capsys, monkeypatch) -> None:
    """The other runs of the pack end bit-identical to the same pack without the NaN (in
    float64 they also equal their runs alone: test_nan_in_float64_leaves_the_others_as_alone)."""
    from bnexp.engine.pack import PackMember

    extra = ["trainer.channels_last=true"] if layout == "channels_last" else []
    assert run_pack(tmp_path / "clean", capsys, extra) == 0
    original = PackMember.next_batch
    drawn = {"count": 0}

    def poisoned(self, swap_rng):
        x, y = original(self, swap_rng)
        if self.index == 1:
            drawn["count"] += 1
            if drawn["count"] == 2:  # run 1's second batch holds a NaN
                x = x.clone()
                x[0, 0, 0, 0] = float("nan")
        return x, y

    monkeypatch.setattr(PackMember, "next_batch", poisoned)
    assert run_pack(tmp_path / "nan", capsys, extra) == 0
    bad = read_summary(tmp_path / "nan" / "run-seed1")
    assert bad["status"] == "diverged" and bad["steps"] == 2  # found at the next check (log_every=1)
    # as alone: an evaluation row when it diverged before its first evaluation
    assert [r["step"] for r in read_metrics(tmp_path / "nan" / "run-seed1" / "metrics.csv")] == ["2"]
    assert "final_top1" in bad and not (tmp_path / "nan" / "run-seed1" / "checkpoint.pt").exists()
    for name in ("run", "run-seed2"):
        clean, poisoned_run = tmp_path / "clean" / name, tmp_path / "nan" / name
        assert read_summary(poisoned_run)["status"] == "completed"
        assert_same_run(clean, poisoned_run)


def pack_dirs(run: Path) -> list[Path]:
    return [run, run.with_name(f"{run.name}-seed1"), run.with_name(f"{run.name}-seed2")]


@pytest.mark.slow
def test_sigkill_then_rerun_resumes_the_whole_pack_bit_exactly(tmp_path: Path) -> None:
    steps = 24
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    done = warm.run([*cli_command(reference, steps), "trainer.pack=3"])
    assert done.returncode == 0, done.stderr
    proc = warm.WarmPopen([*cli_command(killed, steps), "trainer.pack=3"])
    kill_after = random.Random().randrange(2, steps - 10, 2)
    # the last run's checkpoint (the pack writes its runs' in order, so the others' are there)
    wait_for_checkpoint(pack_dirs(killed)[-1], proc, kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = subprocess.run([*cli_command(killed, steps), "trainer.pack=3"], capture_output=True,
                          text=True)  # fresh: a hash seed of its own
    assert done.returncode == 0, (kill_after, done.stderr)
    for a, b in zip(pack_dirs(reference), pack_dirs(killed)):
        assert "resumed_from" in read_summary(b), kill_after
        assert_same_run(a, b)


@pytest.mark.slow
def test_sigterm_checkpoints_every_run_of_the_pack(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = warm.WarmPopen([*cli_command(run, 100_000), "trainer.pack=3"])
    wait_for_checkpoint(pack_dirs(run)[-1], proc, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED and "re-run the same command" in err
    steps = {read_summary(d)["steps"] for d in pack_dirs(run)}
    assert len(steps) == 1 and all(read_summary(d)["status"] == "preempted" for d in pack_dirs(run))
    for d in pack_dirs(run):
        assert checkpoint.load(checkpoint.periodic_checkpoints(d)[0])["step"] == read_summary(d)["steps"]


@pytest.mark.slow
def test_sigterm_while_a_pack_writes_its_final_checkpoints(tmp_path: Path) -> None:
    """The signal comes as the first run's final checkpoint is written: every run of the pack
    completes with its final checkpoint, then the process stops with 75."""
    from tests.test_faults import HOOKED

    done = warm.run([*HOOKED, "sigterm-in-final-save", "train", *PACK_RUN, "trainer.pack=3"], cwd=tmp_path)
    assert done.returncode == EXIT_PREEMPTED, done.stderr[-3000:]
    runs = list((tmp_path / "results" / "runs").iterdir())
    assert len(runs) == 3
    for run in runs:
        assert read_summary(run)["status"] == "completed" and checkpoint.load(run / "checkpoint.pt")["step"] == 6
        assert not list(run.rglob("*.tmp")) and not (run / ".lock").exists()


def test_pack_refuses_what_it_cannot_share(tmp_path: Path, capsys) -> None:
    code, out = run_cli(["train", *PACK_RUN, "trainer.pack=2", "probes=[grad_norm]",
                         f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code != 0 and "runs cannot train as a pack with probes" in out
    code, out = run_cli(["train", *PACK_RUN, "trainer.pack=2", "trainer.batch_size=100", "data.sampling=shuffle",
                         f"hydra.run.dir={tmp_path / 'big'}"], capsys)
    assert code == 2 and "trainer.batch_size=100 is larger than the 64 training images: use trainer.batch_size <= 64" in out


EVERY_MODEL = {  # (overrides, image size)
    "resnet20": (["model=resnet20", "model.width=4"], 8),
    "preact_resnet110": (["model=preact_resnet110", "model.width=2"], 8),
    "resnet18": (["model=resnet18", "model.width=4"], 16),
    "resnet50": (["model=resnet50", "model.width=4"], 16),
    "vgg16": (["model=vgg16", "model.width=4"], 32),
    "cnn5": (["model=cnn5", "model.width=4"], 20),
    "mlp2x100": (["model=mlp2x100", "model.width=6"], 6),
    "efficientnet_b0": (["model=efficientnet_b0", "model.width_mult=0.25", "model.depth_mult=0.25", "model.dropout=0",
                         "model.stochastic_depth=0"], 16),
}
EVERY_NORM = ["bn", "bn_si", "brn", "gn", "ln", "none", "cbn", "popnorm", "bnp", "bnp_gn", "bn_4things"]
# Every norm on the small models; on the large ones (whose layers the small ones share)
# plain and AMAT per-channel statistics, to keep the suite under its 10 minutes.
LARGE = ("preact_resnet110", "resnet18", "resnet50", "vgg16", "efficientnet_b0")
EVERY_PAIR = [(m, n) for m in EVERY_MODEL for n in EVERY_NORM if m not in LARGE or n in ("bn", "cbn")]


@pytest.mark.slow
@pytest.mark.parametrize("model,norm", EVERY_PAIR)
def test_every_model_and_norm_packs_exactly(model: str, norm: str, tmp_path: Path) -> None:
    """Two training steps of every model under every norm, packed against alone, in float64:
    the same weights and statistics to rounding (relative to each tensor's magnitude)."""
    overrides, size = EVERY_MODEL[model]
    groups = ["norm.groups=2"] if "gn" in norm or norm == "bn_4things" else []
    groups += ["norm.ghost_batch=2"] if norm == "bn_4things" else []
    cfg = compose_cfg([*overrides, f"norm={norm}", *PROTOCOL, *groups, "optim.lr=1e-3"])
    spec = DataSpec(10, 3, size)
    models = [seeded(cfg, spec, run) for run in range(RUNS)]
    data = [batches(run, size, 4)[:2] for run in range(RUNS)]
    joined = [(pack_inputs([d[s][0] for d in data]), torch.stack([d[s][1] for d in data], 1)) for s in range(2)]
    packed, _ = train(cfg, pack_models(models), joined, tmp_path, packed_losses)
    for run in range(RUNS):
        alone, _ = train(cfg, seeded(cfg, spec, run), data[run], tmp_path, nn.functional.cross_entropy)
        difference = max_difference(unpack_state(packed.state_dict(), RUNS)[run], alone.state_dict(), True)
        assert_same_to_rounding(difference, 1e-12, cfg, spec, run, data[run], alone, tmp_path, SENSITIVE_2_STEPS,
                                relative=True)


def test_pack_groups_by_everything_but_the_seed() -> None:
    from bnexp.app.sweep import distinct_packs, pack_groups

    jobs = [["norm=bn", "trainer.seed=0"], ["norm=cbn", "trainer.seed=0"], ["trainer.seed=1", "norm=bn"],
            ["norm=bn", "trainer.seed=2"], ["norm=cbn", "trainer.seed=1"], ["norm=bn"]]
    assert pack_groups(jobs) == [[0, 2, 3, 5], [1, 4]]
    # the last bn job has the default seed 0 once resolved: never in a pack with seed 0
    assert distinct_packs([0, 1, 2, 0], 10) == [[0, 1, 2], [3]]
    assert distinct_packs([0, 1, 2, 3], 3) == [[0, 1, 2], [3]]
    assert distinct_packs([5, 6], 1) == [[0], [1]]


def test_pack_launcher_trains_each_cell_s_seeds_together(tmp_path: Path, capsys) -> None:
    root = tmp_path / "sweep"
    code, out = run_cli(["train", "-m", *PACK_RUN, "hydra/launcher=pack", "hydra.launcher.max_pack=2",
                         "trainer.seed=0,1,2", "norm=bn,cbn", f"hydra.sweep.dir={root}"], capsys)
    assert code == 0, out
    assert "6 cells: 6 completed" in out
    summaries = {p.parent.name: json.loads(p.read_text()) for p in root.glob("*/summary.json")}
    assert len(summaries) == 6 and all(s["status"] == "completed" for s in summaries.values())
    for norm in ("bn", "cbn"):
        cell = {s["config"]["trainer"]["seed"]: (name, s) for name, s in summaries.items()
                if s["config"]["norm"]["name"] == norm}
        assert [Path(p).name for p in cell[0][1]["packed_with"]] == [cell[1][0]]
        assert [Path(p).name for p in cell[1][1]["packed_with"]] == [cell[0][0]]
        assert "packed_with" not in cell[2][1]  # the third seed trained alone (max_pack=2)


def test_pack_in_a_sweep_is_the_launcher_s_job(tmp_path: Path, capsys) -> None:
    code, out = run_cli(["train", "-m", *PACK_RUN, "trainer.pack=2", "trainer.seed=0,2",
                         f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code != 0 and "hydra/launcher=pack" in out
    bad = run_cli(["train", "-m", *PACK_RUN, "hydra/launcher=pack", "hydra.launcher.max_pack=0",
                   "trainer.seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep2'}"], capsys)
    assert bad[0] != 0 and "hydra.launcher.max_pack=0" in bad[1]


def test_reproduce_packs_on_a_gpu_unless_told_otherwise(monkeypatch) -> None:
    from bnexp.report.reproduce import default_launcher

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_launcher(["trainer.epochs=3"]) == ["hydra/launcher=pack"]
    assert default_launcher(["hydra/launcher=joblib"]) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_launcher([]) == []


@pytest.mark.slow
@pytest.mark.xdist_group("quick_preset")  # with the other users of quick_preset_runs
def test_reproduce_with_packs_makes_the_same_runs_and_table(tmp_path: Path, capsys, quick_preset_runs: Path) -> None:
    """A preset reproduced with its seeds packed has the same run directories and the same
    table (numbers masked: packed kernels round differently) as one run at a time, and
    ``bnexp table`` reads the packed runs like any others."""
    from tests.test_experiments import masked

    tables = {}
    copy_runs(quick_preset_runs, tmp_path / "basic")  # one run at a time: made by the same command
    for launcher in ("basic", "pack"):
        root = tmp_path / launcher
        code, out = run_cli([*QUICK_PRESET, f"hydra.sweep.dir={root}", f"hydra/launcher={launcher}"], capsys)
        assert code == 0, out
        code, tables[launcher] = run_cli(["table", "popnorm/table2", "scale=quick", f"results={root}"], capsys)
        assert code == 0
        runs = sorted(str(p.parent.relative_to(root)) for p in root.rglob("summary.json"))
        packed = [json.loads(p.read_text()).get("packed_with") for p in root.rglob("summary.json")]
        assert all(packed) == (launcher == "pack") and len(runs) == 4
    assert masked(tables["basic"].replace(str(tmp_path / "basic"), "R")) == \
        masked(tables["pack"].replace(str(tmp_path / "pack"), "R"))


def test_pack_launcher_runs_unpackable_groups_one_at_a_time(tmp_path: Path, capsys) -> None:
    """A group whose settings cannot be packed (here a probe) runs job by job, and a job whose
    seed repeats another's once resolved is not packed with it."""
    root = tmp_path / "sweep"
    code, out = run_cli(["train", "-m", *PACK_RUN, "hydra/launcher=pack", "trainer.seed=0,1", "probes=[loss]",
                         f"hydra.sweep.dir={root}"], capsys)
    assert code == 0, out
    summaries = [json.loads(p.read_text()) for p in root.glob("*/summary.json")]
    assert len(summaries) == 2 and all(s["status"] == "completed" and "packed_with" not in s for s in summaries)
    assert all((p.parent / "probes.csv").is_file() for p in root.glob("*/summary.json"))


def test_stale_checkpoint_of_one_run_does_not_outlive_the_pack(tmp_path: Path, capsys) -> None:
    alone = tmp_path / "run-seed1"
    code, _ = run_cli(["train", *PACK_RUN, "trainer.seed=1", f"hydra.run.dir={alone}"], capsys)
    assert code == 0
    stale = checkpoint.periodic_path(alone, 40)  # as a longer run of seed 1, stopped, would leave
    stale.parent.mkdir(exist_ok=True)
    checkpoint.save_with_checksum(torch.load(alone / "checkpoint.pt", weights_only=False), stale)
    (alone / "checkpoint.pt").unlink()
    summary = read_summary(alone)
    summary["status"] = "failed"
    (alone / "summary.json").write_text(json.dumps(summary))
    assert run_pack(tmp_path, capsys) == 0
    assert not stale.exists() and read_summary(alone)["status"] == "completed"
    assert "resumed_from" not in read_summary(alone)


def test_pack_logs_into_every_run_s_train_log(tmp_path: Path, capsys) -> None:
    assert run_pack(tmp_path, capsys) == 0
    for run_dir in pack_dirs(tmp_path / "run"):
        assert "step 6/6 epoch" in (run_dir / "train.log").read_text()


def test_nan_in_float64_leaves_the_others_as_alone(tmp_path: Path) -> None:
    """A NaN in run 1's third batch: with the pack's criterion (that of :meth:`PackTrainer.criterion`,
    written out here) and the real freezing callback, runs 0 and 2 still equal their runs alone
    after 20 steps, and run 1's parameters stay at zero. The pack's own loop is checked end to
    end by :func:`test_nan_in_one_run_leaves_the_others_bit_identical`."""
    from bnexp.engine.pack import FreezeDiverged

    cfg = compose_cfg(["model=resnet20", "model.width=4", "norm=cbn", *PROTOCOL])
    spec = DataSpec(10, 3, 8)
    data = [batches(run, 8, 8) for run in range(RUNS)]
    data[1][2][0][0, 0, 0, 0] = float("nan")
    packed = pack_models([seeded(cfg, spec, run) for run in range(RUNS)])
    net, state, callbacks = trainer_parts(cfg, packed, tmp_path)
    freezer = FreezeDiverged(RUNS)
    alive = torch.ones(RUNS, dtype=torch.bool)
    for step in range(STEPS):
        x, y = pack_inputs([d[step][0] for d in data]), torch.stack([d[step][1] for d in data], 1)
        _, losses = train_step(net, state.optimizer, [*callbacks, freezer], state, x, y,
                               lambda logits, t: torch.where(alive, packed_losses(logits, t), 0.0))
        state.scheduler.step()
        state.step += 1
        for run in range(RUNS):  # checked every step here (log_every=1)
            if alive[run] and not torch.isfinite(losses[run]):
                alive[run] = False
                freezer.freeze(state, run)
    assert freezer.frozen == [1]
    parts = unpack_state(packed.state_dict(), RUNS)
    assert all(torch.count_nonzero(v) == 0 for k, v in parts[1].items() if k in dict(packed.named_parameters()))
    for run in (0, 2):
        alone, _ = train(cfg, seeded(cfg, spec, run), data[run], tmp_path, nn.functional.cross_entropy)
        assert max_difference(parts[run], alone.state_dict()) < TOL


@pytest.mark.slow
def test_sigkill_after_a_run_diverged_resumes_the_pack_bit_exactly(tmp_path: Path, capsys, monkeypatch) -> None:
    """Run 1 of a pack of 3 diverges at step 2 and is frozen; the pack is killed after its
    step-4 checkpoints. The re-run trains the two others on to the end, bit-identical to the
    uninterrupted pack, and leaves the diverged run as it was."""
    from tests.test_faults import HOOKED

    args = ["train", *(o for o in PACK_RUN if not o.startswith("trainer.max_steps")), "trainer.max_steps=8",
            "trainer.pack=3", "trainer.checkpoint_every=2", "trainer.checkpoint_unit=step"]
    runs = {}
    for name, hook in (("reference", "nan"), ("killed", "nan-then-sigkill:4")):
        (tmp_path / name).mkdir()
        done = warm.run([*HOOKED, hook, *args], cwd=tmp_path / name)
        assert done.returncode == (0 if name == "reference" else -signal.SIGKILL), done.stderr[-3000:]
        runs[name] = sorted((tmp_path / name / "results" / "runs").iterdir(),
                            key=lambda d: OmegaConf.load(d / "config.yaml").trainer.seed)
    assert [read_summary(d)["status"] for d in runs["killed"][1:2]] == ["diverged"]
    assert not any((d / "summary.json").exists() for d in runs["killed"][::2])  # killed before their summaries
    frozen = (runs["killed"][1] / "summary.json").read_text()
    monkeypatch.chdir(tmp_path / "killed")
    code, out = run_cli(args, capsys)
    assert code == 0, out
    assert (runs["killed"][1] / "summary.json").read_text() == frozen
    for reference, resumed in zip(runs["reference"][::2], runs["killed"][::2]):
        assert read_summary(resumed)["resumed_from"].endswith("step-000000004.pt")
        assert_same_run(reference, resumed)


@pytest.mark.parametrize("loader", ["torch", "device"])
def test_seeded_loaders_share_one_copy_of_the_data_and_draw_as_alone(loader: str) -> None:
    """A pack's loaders (:func:`build_seeded_loaders`) share the test batches and, on the
    device path, the training images copied once; each seed's batches, augmentation
    included, are exactly those of its loaders built alone."""
    cfg = compose_cfg([*TINY, "data.augment=true", f"data.loader={loader}"])
    bundle = build_data(cfg.data)
    seeds = [0, 1, 2]
    packed = build_seeded_loaders(bundle, cfg.data, 16, seeds, False)
    assert all(loaders.test is packed[0].test for loaders in packed)
    if loader == "device":
        assert all(loaders.train.split is packed[0].train.split for loaders in packed)

    def first_batches(loaders, seed: int) -> list[torch.Tensor]:
        seed_everything(seed)  # the DataLoader path augments from the global generators
        return [torch.cat([x.flatten(), y.float()]) for x, y in itertools.islice(loaders.epochs_from(0), 9)]

    for seed, loaders in zip(seeds, packed):
        alone = build_loaders(bundle, cfg.data, 16, seed, False)
        assert all(torch.equal(a, b) for a, b in zip(first_batches(loaders, seed), first_batches(alone, seed)))
    shared_test, alone_test = list(packed[0].test), list(build_loaders(bundle, cfg.data, 16, 0, False).test)
    assert len(shared_test) == len(alone_test) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(shared_test, alone_test))
    assert not torch.equal(next(packed[0].epochs_from(0))[0], next(packed[1].epochs_from(0))[0])


def poison_second_batch(monkeypatch, runs: set[int]) -> None:
    """The second training batch of each run of ``runs`` of a pack holds a NaN."""
    from bnexp.engine.pack import PackMember

    original, drawn = PackMember.next_batch, {run: 0 for run in runs}

    def poisoned(self, swap_rng):
        x, y = original(self, swap_rng)
        if self.index in runs:
            drawn[self.index] += 1
            if drawn[self.index] == 2:
                x = x.clone()
                x[0, 0, 0, 0] = float("nan")
        return x, y

    monkeypatch.setattr(PackMember, "next_batch", poisoned)


def record_hook_ends(monkeypatch, method: str) -> list[tuple]:
    """(run, status) for each call of ``method`` of a run's own hook (its weights log), and
    ("shared", status) for the hook the runs of a CBN pack share (AMAT's learning rate)."""
    calls: list[tuple] = []
    monkeypatch.setattr(WeightNormLog, method, lambda self, state, status: calls.append((self.run, status)))
    monkeypatch.setattr(AmatLearningRate, method, lambda self, state, status: calls.append(("shared", status)))
    return calls


@pytest.mark.parametrize("diverging,shared", [({1}, "completed"), ({0, 1, 2}, "diverged")])
def test_pack_hooks_end_with_the_status_of_what_they_serve(diverging: set[int], shared: str, tmp_path: Path,
                                                           monkeypatch) -> None:
    """A run's own hooks end once, with its status: a diverged run's as it diverges, as alone;
    the hooks the pack shares end last, completed when some run completed, diverged when all
    did."""
    from bnexp.engine.pack import train_pack

    ended = record_hook_ends(monkeypatch, "on_train_end")
    poison_second_batch(monkeypatch, diverging)
    summaries = train_pack([compose_cfg([*PACK_RUN, f"trainer.seed={s}"]) for s in range(3)],
                           [tmp_path / str(s) for s in range(3)])
    statuses = ["diverged" if run in diverging else "completed" for run in range(3)]
    assert [s["status"] for s in summaries] == statuses
    assert sorted(ended[:3]) == [(run, status) for run, status in enumerate(statuses)]
    assert ended[:len(diverging)] == [(run, "diverged") for run in sorted(diverging)]  # as they diverged
    assert ended[3:] == [("shared", shared)]


def test_stopped_pack_stops_its_hooks_as_a_run_alone(tmp_path: Path, monkeypatch) -> None:
    """SIGTERM at step 4 of a pack whose run 1 diverged at step 2: the hooks still training
    (the other runs' and the shared ones) get ``on_train_stop(preempted)`` through
    ``ended_on_stop``, as a run alone's do; the diverged run's ended as it diverged."""
    from bnexp.engine.pack import train_pack

    ended, stopped = record_hook_ends(monkeypatch, "on_train_end"), record_hook_ends(monkeypatch, "on_train_stop")
    poison_second_batch(monkeypatch, {1})
    monkeypatch.setattr(AmatLearningRate, "after_step",
                        lambda self, state: os.kill(os.getpid(), signal.SIGTERM) if state.step == 4 else None,
                        raising=False)
    dirs = [tmp_path / str(s) for s in range(3)]
    with pytest.raises(Preempted):
        train_pack([compose_cfg([*PACK_RUN, f"trainer.seed={s}"]) for s in range(3)], dirs)
    assert ended == [(1, "diverged")]
    assert stopped == [("shared", "preempted"), (0, "preempted"), (2, "preempted")]  # in the order of the hooks
    assert [read_summary(d)["status"] for d in dirs] == ["preempted", "diverged", "preempted"]


# The rows of the CBN ablation whose rho is tuned (configs/cbn_row/), and POP-Norm's kappa:
# runs of one row that differ in rho (and seed) train as one pack. Row 6 is torch's BatchNorm
# at rho = 1 and the family elsewhere; its pack gives that run the family's form.
TUNED_ROWS = {"r2": (["norm=cbn"], (0.5, 1.0, 4.0)),
              "r5": (["norm=bn", "norm.placement=before_op", "norm.decouple=true"], (0.5, 1.0, 4.0)),
              "r6": (["norm=bn"], (0.5, 1.0, 4.0)),
              "r7": (["norm=bn", "norm.amat=true"], (0.5, 1.0, 4.0)),
              "popnorm": (["norm=popnorm"], (1.0, 4.0, 16.0))}


def rho_pack(row: str, rhos, tmp_path: Path, conv: str = "grouped"):
    """20 steps of a pack of ResNet-20 runs of ``row``, run ``r`` at ``rhos[r]`` with seed ``r``:
    the configs, each run's data, the trained pack and its optimizer / hook state."""
    norm, _ = TUNED_ROWS[row]
    overrides, size, batch = MODELS["resnet20"]
    cfgs = [compose_cfg([*overrides, *norm, f"norm.rho={rho}", *PROTOCOL]) for rho in rhos]
    spec = DataSpec(10, 3, size)
    data = [batches(run, size, batch) for run in range(len(rhos))]
    packed = pack_models([seeded(cfg, spec, run) for run, cfg in enumerate(cfgs)], conv)
    joined = [(pack_inputs([d[s][0] for d in data]), torch.stack([d[s][1] for d in data], 1)) for s in range(STEPS)]
    packed, extra = train(cfgs[0], packed, joined, tmp_path, packed_losses)
    return cfgs, data, packed, extra


@pytest.mark.parametrize("row", [pytest.param(row, marks=[pytest.mark.slow] if row in ("r5", "r7", "popnorm") else [])
                                 for row in sorted(TUNED_ROWS)])  # CBN (AMAT) and BN mixed with the family always
def test_mixed_rho_pack_equals_runs_alone_in_float64(row: str, tmp_path: Path) -> None:
    """A pack across the rho grid: each run equals the same run trained alone (its own rho,
    its own seed and batches) after 20 steps with momentum, weight decay, warmup, an lr
    milestone and AMAT's changing eta, to below 1e-10 in float64."""
    rhos = TUNED_ROWS[row][1]
    cfgs, data, packed, extra = rho_pack(row, rhos, tmp_path)
    spec = DataSpec(10, 3, MODELS["resnet20"][1])
    for run, cfg in enumerate(cfgs):
        alone, extra_alone = train(cfg, seeded(cfg, spec, run), data[run], tmp_path, nn.functional.cross_entropy)
        assert cfg.norm.rho == rhos[run]
        difference = max(max_difference(unpack_state(packed.state_dict(), RUNS)[run], alone.state_dict()),
                         max_difference(unpack_state(extra, RUNS)[run], extra_alone))
        assert difference < TOL, (row, run, difference)
    held = [m.rho_channels for m in packed.modules() if isinstance(m, NormFamily)]
    assert held and all(torch.equal(r, torch.tensor(rhos, dtype=torch.float64).repeat_interleave(len(r) // RUNS))
                        for r in held)


def test_run_of_a_mixed_rho_pack_is_bit_identical_to_its_rho_s_own_pack(tmp_path: Path) -> None:
    """Nothing of one run reaches another: run 0 of a pack at rho (0.5, 1, 4) is bit for bit
    run 0 of the pack at rho (0.5, 0.5, 0.5)."""
    _, _, mixed, mixed_extra = rho_pack("r2", (0.5, 1.0, 4.0), tmp_path)
    _, _, same, same_extra = rho_pack("r2", (0.5, 0.5, 0.5), tmp_path)
    assert max_difference(unpack_state(mixed.state_dict(), RUNS)[0], unpack_state(same.state_dict(), RUNS)[0]) == 0
    assert max_difference(unpack_state(mixed_extra, RUNS)[0], unpack_state(same_extra, RUNS)[0]) == 0


def test_streams_compute_what_the_grouped_convolution_computes(tmp_path: Path) -> None:
    """``trainer.pack_conv=streams`` (one convolution per run) against the grouped one, in
    float64: one layer's output and gradients to rounding, and 20 training steps of a pack."""
    from bnexp.nn.packed import PackedConv2d

    layers = [PackedConv2d(3, conv, 3 * 4, 3 * 6, 3, 2, 1, groups=3 * 2, bias=True).double() for conv in
              ("grouped", "streams")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(5, 12, 9, 9, dtype=torch.float64, requires_grad=True)
    outs = [layer(x) for layer in layers]
    grads = [torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]) for out, layer in zip(outs, layers)]
    assert (outs[0] - outs[1]).abs().max() < 1e-13
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(*grads))
    torch.autograd.gradcheck(layers[1], (x[:2, :, :5, :5].detach().requires_grad_(),))
    _, _, grouped, grouped_extra = rho_pack("r2", (0.5, 1.0, 4.0), tmp_path)
    _, _, streams, streams_extra = rho_pack("r2", (0.5, 1.0, 4.0), tmp_path, conv="streams")
    assert max_difference(grouped.state_dict(), streams.state_dict()) < TOL
    assert max_difference(grouped_extra, streams_extra) < TOL


def test_runs_that_differ_in_a_constant_of_a_layer_do_not_pack() -> None:
    from bnexp.support.errors import ConfigError

    cfgs = [compose_cfg(["model=resnet20", "model.width=4", "norm=cbn", f"norm.eps={eps}"]) for eps in (1e-5, 1e-3)]
    models = [build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 8)) for cfg in cfgs]
    with pytest.raises(ConfigError, match=r"differ in stem\.pre\.eps \(1e-05 and 0\.001\)"):
        pack_models(models)


@pytest.mark.slow
@pytest.mark.parametrize("key,values,others", [("norm.rho", (0.5, 2.0, 4.0), (1.0, 0.25, 8.0)),
                                               ("optim.lr", (0.05, 0.1, 0.2), (0.01, 0.3, 0.02))])
def test_a_worker_s_next_pack_of_other_rho_compiles_nothing_new(key: str, values, others, tmp_path: Path,
                                                                monkeypatch) -> None:
    """``trainer.compile``: a process that trains pack after pack (a worker) keeps the first
    pack's model, wrapper and optimizer for the next pack of the same layers. Packs of other rho
    values (or learning rates) and seeds then run through the graphs dynamo traced for the
    first (its counters do not move: rho and the rates are tensors the graphs read), and
    nothing of one pack reaches the next: the same pack trained after a pack of other values
    and again after itself is bit-identical.
    (Dynamo traces with its eager backend here: what is traced is what counts, and inductor
    would only add minutes of CPU codegen.)"""
    from torch._dynamo.utils import counters

    from bnexp.engine import pack as pack_module
    from bnexp.engine.pack import train_pack

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compile_(*a, **{"backend": "eager", **k}))
    monkeypatch.setattr(pack_module, "_compiled", [])
    torch._dynamo.reset()
    counters.clear()

    def pack(rhos, seeds, name: str) -> list[Path]:
        cfgs = [compose_cfg([*PACK_RUN, "trainer.compile=true", f"{key}={rho}", f"trainer.seed={seed}"])
                for rho, seed in zip(rhos, seeds)]
        dirs = [tmp_path / name / str(i) for i in range(len(cfgs))]
        assert all(s["status"] == "completed" for s in train_pack(cfgs, dirs))
        return dirs

    pack(values, (3, 4, 5), "first")
    traced = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
    assert traced[0] > 0
    model = pack_module._compiled[0].model
    pack(others, (0, 1, 2), "other")
    after_other = pack(values, (3, 4, 5), "after-other")
    after_itself = pack(values, (3, 4, 5), "after-itself")
    assert (counters["stats"]["unique_graphs"], counters["frames"]["total"]) == traced
    assert pack_module._compiled[0].model is model
    for a, b in zip(after_other, after_itself):
        assert_same_run(a, b)
