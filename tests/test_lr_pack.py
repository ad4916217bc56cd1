"""Packs across learning rates (issue 36): runs that differ in optim.lr / lr_g / lr_w under one
schedule shape train as one pack, each at its own rates (bnexp.engine.optim.RunSchedules),
and compute what they compute alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import TrainState
from bnexp.engine.method_hooks import WeightNormLog, method_callbacks
from bnexp.engine.optim import RunSchedules, build_optimizer, build_schedule, group_rates
from bnexp.engine.pack import FreezeDiverged
from bnexp.engine.step import TrainMeter, TrainStep
from bnexp.engine.trainer import end_step
from bnexp.models import DataSpec, build_model
from bnexp.models.packing import pack_inputs, pack_models, packed_losses, unpack_state
from bnexp.support.errors import ConfigError
from bnexp.support.runinfo import seed_everything
from tests.conftest import TINY, compose_cfg, read_metrics, read_summary, run_cli
from tests.test_step import same_bits

CPU = torch.device("cpu")
STEPS, STEPS_PER_EPOCH = 20, 8  # the table of rates filled at steps 0, 8 and 16
SPEC = DataSpec(10, 3, 8)
# momentum and weight decay, a 3-step linear warmup, the lr divided by 10 at step 10
PROTOCOL = ["model=resnet20", "model.width=4", "optim.momentum=0.9", "optim.weight_decay=5e-4",
            "schedule.unit=step", "schedule.milestones=[10]", "schedule.warmup=3", "schedule.warmup_mode=linear",
            "trainer.device=cpu"]
# CBN with adaptive AMAT (eta = max(1 - 10 lr, 0): 0.5, 0 and 0.9 at these rates before the
# milestone) and BN whose scale-invariant weights take lr_w (Arora et al.'s grid)
GRIDS = {"cbn": (["norm=cbn"], [["optim.lr=0.05"], ["optim.lr=0.2"], ["optim.lr=0.01"]]),
         "bn_lr_w": (["norm=bn", "optim.lr=0.05"], [["optim.lr_w=0.05"], ["optim.lr_w=1.0"], ["optim.lr_w=0.01"]])}


class Runs:
    """Runs of ``base + own[k]`` trained together as one pack (one run: alone) by the engine's
    step, each on its own :data:`STEPS` batches; the rates each run's step took."""

    def __init__(self, base: list[str], own: list[list[str]], dtype: torch.dtype, tmp_path: Path,
                 seeds: list[int]) -> None:
        self.cfgs = [compose_cfg([*PROTOCOL, *base, *o]) for o in own]
        models = []
        for seed, cfg in zip(seeds, self.cfgs):
            seed_everything(seed)
            models.append(build_model(cfg.model, cfg.norm, cfg.act.name, SPEC).to(CPU, dtype))
        self.runs = len(models)
        self.model = pack_models(models) if self.runs > 1 else models[0]
        cfg = self.cfgs[0]
        optimizer = build_optimizer(self.model, cfg.optim)
        scheduler = build_schedule(optimizer, cfg.schedule, STEPS_PER_EPOCH)
        self.state = TrainState(cfg, tmp_path, CPU, self.model, optimizer, scheduler, STEPS_PER_EPOCH, STEPS)
        rates = [group_rates(c.optim, len(optimizer.param_groups)) for c in self.cfgs]
        if any(r != rates[0] for r in rates):
            self.state.run_rates = RunSchedules(cfg.schedule, STEPS_PER_EPOCH, rates)
        self.callbacks = [*(cb for cb in method_callbacks(cfg) if not isinstance(cb, WeightNormLog)),
                          FreezeDiverged(self.runs)]
        for cb in self.callbacks:
            cb.on_train_start(self.state)
        self.meter = TrainMeter(CPU, self.runs)
        data = [batches(seed, dtype) for seed in seeds]
        self.data = data[0] if self.runs == 1 else [
            (pack_inputs([d[s][0] for d in data]), torch.stack([d[s][1] for d in data], 1)) for s in range(STEPS)]
        self.rates: list[list[float]] = []  # per step: each run's group rates

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return packed_losses(logits, y) if self.runs > 1 else nn.functional.cross_entropy(logits, y)

    def train(self, steps: int = STEPS, step: TrainStep | None = None) -> TrainStep:
        step = step or TrainStep(self.state, AmpCompileWrapper(self.model, CPU), self.meter, self.callbacks,
                                 self.criterion, iter(self.data[self.state.step:]))
        for _ in range(steps):
            step.run()
            self.rates.append(step.lr.tolist())
            end_step(self.state, self.callbacks, _NoBar())
        return step

    def run_state(self, run: int) -> dict[str, torch.Tensor]:
        """Run ``run``'s weights, buffers and momentum."""
        model = self.model.state_dict()
        momentum = {f"momentum.{i}": s["momentum_buffer"] for i, s in enumerate(self.state.optimizer.state.values())}
        if self.runs == 1:
            return {**model, **momentum}
        return {**unpack_state(model, self.runs)[run], **unpack_state(momentum, self.runs)[run]}


class _NoBar:
    def update(self, n: int) -> None:
        """tqdm's update, unused here."""


def batches(seed: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(8, 3, 8, 8, generator=g, dtype=dtype) * 2 + 0.5, torch.randint(10, (8,), generator=g))
            for _ in range(STEPS)]


def run_rates(runs: Runs, run: int) -> list[list[float]]:
    """The group rates run ``run`` took at each step (a pack's are ``(groups, runs)``)."""
    return [[group[run] if isinstance(group, list) else group for group in step] for step in runs.rates]


@pytest.mark.parametrize("grid", list(GRIDS))
def test_mixed_lr_pack_equals_runs_alone_in_float64(grid: str, tmp_path: Path) -> None:
    """Each run of a pack across three learning rates equals the same run alone after 20 steps
    crossing the warmup, a milestone and three epochs' tables, to below 1e-10 in float64
    (the grouped kernels' rounding), and took exactly the rates its schedule alone gives."""
    base, own = GRIDS[grid]
    pack = Runs(base, own, torch.float64, tmp_path, [0, 1, 2])
    pack.train()
    for run in range(3):
        alone = Runs(base, [own[run]], torch.float64, tmp_path, [run])
        alone.train()
        assert run_rates(pack, run) == run_rates(alone, 0)
        a, b = pack.run_state(run), alone.run_state(0)
        assert a.keys() == b.keys()
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-10, (grid, run)
    assert len({tuple(map(tuple, r)) for r in pack.rates}) > 4  # warmup, milestone, and the runs apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid", list(GRIDS))
def test_run_of_a_mixed_lr_pack_is_bit_identical_to_its_lr_s_own_pack(grid: str, dtype: torch.dtype,
                                                                      tmp_path: Path) -> None:
    """The per-run rates compute what one rate for all computes, bit for bit: run 0 of a pack
    at three learning rates is run 0 of the pack whose three runs all take run 0's."""
    base, own = GRIDS[grid]
    mixed = Runs(base, own, dtype, tmp_path, [0, 1, 2])
    same = Runs(base, [own[0]] * 3, dtype, tmp_path, [0, 1, 2])
    assert mixed.state.run_rates is not None and same.state.run_rates is None
    mixed.train()
    same.train()
    a, b = mixed.run_state(0), same.run_state(0)
    assert [k for k in a if not same_bits(a[k], b[k])] == []


def test_a_mixed_lr_pack_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Each run's checkpoint holds its own schedule and rates (what the run alone holds at that
    step), and a pack restored from them after 10 steps ends as the pack never stopped."""
    base, own = GRIDS["cbn"]
    whole = Runs(base, own, torch.float32, tmp_path, [0, 1, 2])
    whole.train()
    first = Runs(base, own, torch.float32, tmp_path, [0, 1, 2])
    first.train(10)
    payloads = [{"optimizer": first.state.optimizer.state_dict(), "scheduler": first.state.scheduler.state_dict()}
                for _ in range(3)]
    for run, payload in enumerate(payloads):
        first.state.run_rates.into_payload(run, payload)
        alone = Runs(base, [own[run]], torch.float32, tmp_path, [run])
        alone.train(10)
        assert payload["scheduler"] == alone.state.scheduler.state_dict()
        assert [g["lr"] for g in payload["optimizer"]["param_groups"]] == alone.state.group_lrs()
    second = Runs(base, own, torch.float32, tmp_path, [0, 1, 2])
    second.model.load_state_dict(first.model.state_dict())
    second.state.optimizer.load_state_dict(payloads[0]["optimizer"])
    second.state.scheduler.load_state_dict(payloads[0]["scheduler"])
    second.state.run_rates.restore(payloads, [True] * 3)
    for cb, theirs in zip(second.callbacks, first.callbacks):
        cb.load_state_dict(theirs.state_dict())
    second.state.step = 10
    second.train(10)
    assert run_rates(second, 1) == run_rates(whole, 1)[10:]
    a, b = second.run_state(1), whole.run_state(1)
    assert [k for k in a if not same_bits(a[k], b[k])] == []


def sweep(run: list[str], folder: Path, capsys) -> dict[float, Path]:
    """``bnexp train -m RUN hydra/launcher=pack`` into ``folder``; each run's directory by its lr."""
    code, out = run_cli(["train", "-m", *run, "hydra/launcher=pack", f"hydra.sweep.dir={folder}"], capsys)
    assert code == 0, out
    return {read_summary(d)["config"]["optim"]["lr"]: d for d in folder.iterdir() if (d / "summary.json").is_file()}


def same_checkpoints(a: Path, b: Path) -> None:
    """Two runs' final checkpoints: the same weights bit for bit, schedule state and group rates."""
    x, y = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (a, b))
    assert [k for k in x["model"] if not same_bits(x["model"][k], y["model"][k])] == []
    assert x["scheduler"] == y["scheduler"]
    assert [g["lr"] for g in x["optimizer"]["param_groups"]] == [g["lr"] for g in y["optimizer"]["param_groups"]]


def lr_column(run_dir: Path) -> list[str]:
    return [r["lr"] for r in read_metrics(run_dir / "metrics.csv")]


LR_SWEEP = [*TINY, "norm=cbn", "trainer.max_steps=6", "trainer.eval_every=1", "trainer.eval_unit=step",
            "schedule.unit=step", "schedule.milestones=[4]", "trainer.checkpoint_every=2",
            "trainer.checkpoint_unit=step", "optim.lr=0.05,0.2"]


def test_lr_sweep_packs_resumes_and_each_run_is_its_own(tmp_path: Path, capsys, monkeypatch) -> None:
    """``bnexp train -m ... optim.lr=0.05,0.2 hydra/launcher=pack``: one pack whose runs have
    the fingerprints, lr columns, schedule states and group rates of the same runs alone. Cut
    after its step-4 checkpoint, its lr=0.2 run resumed alone by a plain ``bnexp train`` ends
    at its own rates, and the sweep run again resumes the pack, which ends bit for bit as the
    pack never cut."""
    from bnexp.engine.identity import fingerprint
    from bnexp.engine.trainer import Trainer

    alone_run = [o for o in LR_SWEEP if not o.startswith("optim.lr=")]
    whole = sweep(LR_SWEEP, tmp_path / "whole", capsys)
    assert sorted(whole) == [0.05, 0.2]
    for lr, run_dir in whole.items():
        summary = read_summary(run_dir)
        assert summary["status"] == "completed" and summary["packed_with"] == [str(d) for d in whole.values() if d != run_dir]
        assert summary["fingerprint"] == fingerprint(compose_cfg([*alone_run, f"optim.lr={lr}"]))
        alone = tmp_path / f"alone{lr}"
        assert run_cli(["train", *alone_run, f"optim.lr={lr}", f"hydra.run.dir={alone}"], capsys)[0] == 0
        assert lr_column(run_dir) == lr_column(alone) and len(set(lr_column(run_dir))) == 2
        x, y = (torch.load(d / "checkpoint.pt", weights_only=False) for d in (run_dir, alone))
        assert x["scheduler"] == y["scheduler"]
        assert [g["lr"] for g in x["optimizer"]["param_groups"]] == [g["lr"] for g in y["optimizer"]["param_groups"]]

    def cut(self, lr):
        raise RuntimeError("cut before the end")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "finish", cut)
        run_cli(["train", "-m", *LR_SWEEP, "hydra/launcher=pack", f"hydra.sweep.dir={tmp_path / 'cut'}"], capsys)
    cut_dirs = {read_summary(d)["config"]["optim"]["lr"]: d for d in (tmp_path / "cut").iterdir()
                if (d / "summary.json").is_file()}
    assert [read_summary(d)["status"] for d in cut_dirs.values()] == ["failed"] * 2
    resumed_alone = tmp_path / "resumed-alone"
    shutil.copytree(cut_dirs[0.2], resumed_alone)
    assert run_cli(["train", *alone_run, "optim.lr=0.2", f"hydra.run.dir={resumed_alone}"], capsys)[0] == 0
    assert "resumed_from" in read_summary(resumed_alone)
    assert lr_column(resumed_alone) == lr_column(tmp_path / "alone0.2")
    resumed = sweep(LR_SWEEP, tmp_path / "cut", capsys)
    for lr in (0.05, 0.2):
        assert read_summary(resumed[lr])["resumed_from"].endswith("step-000000004.pt")
        assert lr_column(resumed[lr]) == lr_column(whole[lr])
        same_checkpoints(resumed[lr], whole[lr])


def test_lr_w_pack_logs_each_run_s_lr_w(tmp_path: Path, capsys) -> None:
    """Arora's grid: a pack across ``optim.lr_w``; each run's weights.csv holds its own lr_w and
    effective rates, those of the same run alone."""
    run = [*TINY, "norm=bn", "optim.lr=0.1", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.eval_unit=step",
           "schedule.unit=step", "schedule.milestones=[2]"]
    code, out = run_cli(["train", "-m", *run, "optim.lr_w=0.05,2.0", "hydra/launcher=pack",
                         f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert code == 0, out
    assert "lr_w 0.05: " in out and "lr_w 2.0: " in out  # the console names each run by its lr_w
    dirs = [d for d in (tmp_path / "sweep").iterdir() if (d / "summary.json").is_file()]
    assert len(dirs) == 2 and all(len(read_summary(d)["packed_with"]) == 1 for d in dirs)
    logged = []
    for run_dir in dirs:
        lr_w = read_summary(run_dir)["config"]["optim"]["lr_w"]
        alone = tmp_path / f"alone{lr_w}"
        assert run_cli(["train", *run, f"optim.lr_w={lr_w}", f"hydra.run.dir={alone}"], capsys)[0] == 0
        packed, own = (read_metrics(d / "weights.csv") for d in (run_dir, alone))
        logged.append([(r["step"], r["layer"], r["lr_w"]) for r in packed])
        assert logged[-1] == [(r["step"], r["layer"], r["lr_w"]) for r in own]
    assert logged[0] != logged[1]


def test_runs_at_other_rates_pack_under_sgd_only() -> None:
    """Adam reads its rates on the host: its runs at two rates are not one pack (the check
    names the keys and the values), and the launcher keeps them apart."""
    from bnexp.app.sweep import pack_groups
    from bnexp.engine.pack import apart, check_pack

    cfgs = [compose_cfg([*TINY, "optim=adam", f"optim.lr={lr}"]) for lr in (1e-3, 1e-2)]
    with pytest.raises(ConfigError, match=r"under optim=sgd only .* \[\(0\.001, None, None\), \(0\.01, None, None\)\]"):
        check_pack(cfgs)
    jobs = [[f"optim.lr={lr}"] for lr in (1e-3, 1e-2)]
    assert pack_groups(jobs, apart=[apart(c) for c in cfgs]) == [[0], [1]]
    sgd = [compose_cfg([*TINY, f"optim.lr={lr}"]) for lr in (1e-3, 1e-2)]
    check_pack(sgd)
    assert pack_groups(jobs, apart=[apart(c) for c in sgd]) == [[0, 1]]


def test_pack_conv_auto_keeps_the_faster_form_once_per_kind(tmp_path: Path, capsys, monkeypatch) -> None:
    """``trainer.pack_conv=auto`` times both forms of the pack about to train and keeps the
    faster (here made ``streams``, then ``grouped``), measures each kind of pack once per
    process, records the form in each run's summary and says so in one line."""
    from bnexp.engine import pack_size

    measured: list[str] = []
    faster = {"value": "streams"}

    def timed(cfg, spec, runs, device, conv):
        measured.append(conv)
        return 1.0 if conv == faster["value"] else 2.0

    monkeypatch.setattr(pack_size, "conv_seconds", timed)
    monkeypatch.setattr(pack_size, "_conv_forms", {})
    cfg = compose_cfg([*TINY, "norm=cbn", "trainer.pack_conv=auto"])
    spec = DataSpec(10, 3, 8)
    assert pack_size.conv_form(cfg, spec, 3, CPU) == "streams" and measured == ["grouped", "streams"]
    assert pack_size.conv_form(cfg, spec, 3, CPU) == "streams" and len(measured) == 2  # measured once
    faster["value"] = "grouped"
    assert pack_size.conv_form(cfg, spec, 4, CPU) == "grouped" and len(measured) == 4  # another kind: K = 4
    assert pack_size.conv_form(cfg, spec, 1, CPU) == "grouped" and len(measured) == 4  # a run alone: nothing to pack
    plain = compose_cfg([*TINY, "norm=cbn", "trainer.pack_conv=streams"])
    assert pack_size.conv_form(plain, spec, 3, CPU) == "streams" and len(measured) == 4  # a form given: kept
    faster["value"] = "streams"
    monkeypatch.setattr(pack_size, "_conv_forms", {})
    code, out = run_cli(["train", *TINY, "norm=cbn", "trainer.max_steps=2", "trainer.pack=2", "trainer.pack_conv=auto",
                         f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code == 0, out
    assert "trainer.pack_conv=auto: streams for packs of 2 resnet20 runs on cpu" in out
    assert "2000.0 ms grouped, 1000.0 ms streams" in out
    assert [read_summary(d)["pack_conv"] for d in (tmp_path / "run", tmp_path / "run-seed1")] == ["streams"] * 2


def test_pack_conv_auto_measures_real_steps_of_both_forms(monkeypatch) -> None:
    """Unpatched, the measurement trains real steps of both forms and picks the one it timed faster."""
    from bnexp.engine import pack_size

    seconds: dict[str, float] = {}
    real = pack_size.conv_seconds

    def recorded(cfg, spec, runs, device, conv):
        seconds[conv] = real(cfg, spec, runs, device, conv)
        return seconds[conv]

    monkeypatch.setattr(pack_size, "conv_seconds", recorded)
    monkeypatch.setattr(pack_size, "_conv_forms", {})
    cfg = compose_cfg([*TINY, "norm=cbn", "trainer.pack_conv=auto"])
    chosen = pack_size.conv_form(cfg, DataSpec(10, 3, 8), 2, CPU)
    assert set(seconds) == {"grouped", "streams"} and all(s > 0 for s in seconds.values())
    assert chosen in seconds and pack_size.conv_form(cfg, DataSpec(10, 3, 8), 2, CPU) == chosen and len(seconds) == 2


def test_pack_conv_auto_keeps_the_form_a_resumed_pack_trained_with(tmp_path: Path, capsys, monkeypatch) -> None:
    """A pack cut after a checkpoint resumes with the form it trained with (recorded in its
    checkpoints), whatever a new measurement would choose: a resume continues bit for bit."""
    from bnexp.engine import pack_size
    from bnexp.engine.trainer import Trainer

    faster = {"value": "streams"}
    monkeypatch.setattr(pack_size, "conv_seconds", lambda cfg, spec, runs, device, conv: 1.0 if conv == faster["value"] else 2.0)
    monkeypatch.setattr(pack_size, "_conv_forms", {})
    run = ["train", *TINY, "norm=cbn", "trainer.max_steps=4", "trainer.pack=2", "trainer.pack_conv=auto",
           "trainer.checkpoint_every=2", "trainer.checkpoint_unit=step", f"hydra.run.dir={tmp_path / 'run'}"]

    def cut(self, lr):
        raise RuntimeError("cut before the end")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "finish", cut)
        run_cli(run, capsys)
    faster["value"] = "grouped"
    monkeypatch.setattr(pack_size, "_conv_forms", {})
    code, out = run_cli(run, capsys)
    assert code == 0, out
    assert "trainer.pack_conv=auto: streams, the form this pack trained with before it stopped" in out
    assert [read_summary(d)["pack_conv"] for d in (tmp_path / "run", tmp_path / "run-seed1")] == ["streams"] * 2
    assert read_summary(tmp_path / "run")["resumed_from"].endswith("step-000000002.pt")


def test_claim_cells_and_the_reproduce_plan_group_rates_as_they_train() -> None:
    """A claim's cells hold one rate each (its seeds pack, its rates do not: a cell is one
    ``bnexp train -m``); ``bnexp reproduce``'s plan cuts a group by rate under Adam only."""
    from bnexp.report.reproduce import rate_parts
    from bnexp.studies.claims import CLAIMS, arm_cells

    cells = arm_cells(CLAIMS["arora"].arms[0], Path("out"), "full", [])
    rates = [next(a for a in c.args if a.startswith("optim.lr_w=")) for c in cells]
    assert len(cells) == 5 and len(set(rates)) == 5 and not any("," in r for r in rates)
    jobs = [["optim.lr=1e-3", "trainer.seed=0"], ["optim.lr=1e-2", "trainer.seed=0"], ["optim.lr=1e-3", "trainer.seed=1"]]
    assert rate_parts(jobs, [0, 1, 2], compose_cfg([*TINY, "optim=adam"])) == [[0, 2], [1]]
    assert rate_parts(jobs, [0, 1, 2], compose_cfg(TINY)) == [[0, 1, 2]]
