"""The engine's step (bnexp/engine/step.py) computes what the step before it computed, bit for
bit, and asks nothing of the host: no read of a device value, no tensor made from host data,
no host value that changes from step to step (what a CUDA graph would bake in)."""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from bnexp.data import build_data
from bnexp.data.device import PackedEpochs
from bnexp.data.loaders import build_seeded_loaders
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.evaluation import DeviceEvaluation
from bnexp.engine.method_hooks import AmatLearningRate, BnpPreconditioner, WeightNormLog, method_callbacks
from bnexp.engine.optim import build_optimizer, build_schedule
from bnexp.engine.pack import FreezeDiverged
from bnexp.engine.step import HostUse, LrAhead, TrainMeter, TrainStep
from bnexp.engine.trainer import evaluate, train, train_step
from bnexp.models import DataSpec, build_model
from bnexp.models.packing import pack_inputs, pack_models, packed_losses
from bnexp.nn import BatchRenorm2d, CBN2d, FourThingsBN2d, NormFamily
from bnexp.support.runinfo import seed_everything
from tests.conftest import TINY, compose_cfg, read_metrics

CPU = torch.device("cpu")
RUNS = 2
STEPS = 20
STEPS_PER_EPOCH = 8  # the table of rates is filled at steps 0, 8 and 16
NAN_AT, FREEZE_AT = 12, 14  # run 1's loss turns NaN at step 12; it is frozen at step 14, as the trainer does
# momentum and weight decay, a 3-step linear warmup, the lr divided by 10 at step 10
PROTOCOL = ["model=resnet20", "model.width=4", "optim.lr=0.05", "optim.momentum=0.9", "optim.weight_decay=5e-4",
            "schedule.unit=step", "schedule.milestones=[10]", "schedule.warmup=3", "schedule.warmup_mode=linear",
            "trainer.device=cpu"]
NORMS = {  # brn with its schedule within the 20 steps; bn_4things with ghost batches and its pull toward 1 and 0
    "bn": [], "cbn": [], "bnp": [], "brn": ["norm.relax_start=2", "norm.r_max_step=12", "norm.d_max_step=8"],
    "bn_4things": ["norm.ghost_batch=3"],
}
SPEC = DataSpec(10, 3, 8)
# issue 36's packs across rho (each run's rho a buffer of its channels): CBN's row 2, and row 6,
# whose run at rho = 1 is torch's BatchNorm and takes the family's form beside the run at 4
MIXED_RHO = {"cbn": (0.5, 4.0), "bn": (1.0, 4.0)}


class Pack:
    """A pack of :data:`RUNS` ResNet-20s with the trainer's optimizer, schedule, method hooks
    and frozen-run mask, and :data:`STEPS` batches of its own, NaN in run 1 at :data:`NAN_AT`;
    run ``r`` at ``norm.rho=rhos[r]`` when ``rhos`` are given."""

    def __init__(self, norm: str, dtype: torch.dtype, tmp_path: Path, device: torch.device = CPU,
                 rhos: tuple[float, ...] = ()) -> None:
        cfgs = [compose_cfg([*PROTOCOL, f"norm={norm}", *NORMS[norm], *(f"norm.rho={rho}" for rho in rhos[run:run + 1])])
                for run in range(RUNS)]
        cfg = cfgs[0]
        models = []
        for run, run_cfg in enumerate(cfgs):
            seed_everything(run)
            models.append(build_model(run_cfg.model, run_cfg.norm, run_cfg.act.name, SPEC).to(device, dtype))
        self.model = pack_models(models)
        self.net = AmpCompileWrapper(self.model, device)
        optimizer = build_optimizer(self.model, cfg.optim)
        scheduler = build_schedule(optimizer, cfg.schedule, STEPS_PER_EPOCH)
        self.state = TrainState(cfg, tmp_path, device, self.model, optimizer, scheduler, STEPS_PER_EPOCH, STEPS)
        self.freezer = FreezeDiverged(RUNS, device)
        self.callbacks = [*(cb for cb in method_callbacks(cfg) if not isinstance(cb, WeightNormLog)), self.freezer]
        for cb in self.callbacks:
            cb.on_train_start(self.state)
        self.meter = TrainMeter(device, RUNS)
        g = torch.Generator().manual_seed(7)
        self.data = [(torch.randn(8, 3 * RUNS, 8, 8, generator=g, dtype=dtype) * 2 + 0.5,
                      torch.randint(10, (8, RUNS), generator=g)) for _ in range(STEPS)]
        self.data[NAN_AT][0][:, 3:] = float("nan")
        self.data = [(x.to(device), y.to(device)) for x, y in self.data]
        self.rates: list[float] = []

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.where(self.freezer.alive, packed_losses(logits, y), 0.0)

    def train(self, step: Callable[[torch.Tensor, torch.Tensor], None], steps: range = range(STEPS)) -> None:
        """``step(x, y)`` for each of ``steps``, with the schedule and the freeze around it."""
        for s in steps:
            if s == FREEZE_AT:
                self.freezer.freeze(self.state, 1)
            self.rates.append(self.state.lr)
            step(*self.data[s])
            self.state.scheduler.step()
            self.state.step += 1

    def todays_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        logits, loss = train_step(self.net, self.state.optimizer, self.callbacks, self.state, x, y, self.criterion)
        self.meter.add(loss.detach(), logits.detach(), y)

    def engine_step(self) -> TrainStep:
        return TrainStep(self.state, self.net, self.meter, self.callbacks, self.criterion, iter(self.data))

    def everything(self) -> dict[str, torch.Tensor]:
        """Weights, buffers, momentum, the hooks' state and the training sums."""
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        out.update({f"momentum.{i}": s["momentum_buffer"] for i, s in enumerate(self.state.optimizer.state.values())})
        for cb in self.callbacks:
            out.update({f"{type(cb).__name__}.{k}": v for k, v in cb.state_dict().items()})
        out["meter"] = self.meter.sums
        return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs and the sign of zero included)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    ints = {torch.float64: torch.int64, torch.float32: torch.int32}[a.dtype]
    return a.shape == b.shape and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def assert_engine_step_is_todays(today: Pack, engine: Pack) -> None:
    """20 steps of two copies of a pack, ``today`` with the step before the engine's and
    ``engine`` with :class:`TrainStep`, crossing the warmup, an lr milestone, two epochs'
    tables and a divergence (NaN, then the run frozen): every weight, buffer, momentum, hook
    state and training sum equal bit for bit, and the device's rates the schedule's."""
    today.train(today.todays_step)
    step = engine.engine_step()
    rates = []
    engine.train(lambda x, y: (step.run(), rates.append(float(step.lr[0]))))
    assert rates == today.rates == engine.rates and len(set(rates)) == 4  # warmup 0.1, 0.4, 0.7, then 1 and 0.1
    a, b = today.everything(), engine.everything()
    assert a.keys() == b.keys()
    assert [k for k in a if not same_bits(a[k], b[k])] == []
    assert not any(p.isnan().any() for p in engine.model.parameters())  # the NaN run was frozen (zeroed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", list(NORMS))
def test_step_is_bit_identical_to_todays(norm: str, dtype: torch.dtype, tmp_path: Path) -> None:
    assert_engine_step_is_todays(Pack(norm, dtype, tmp_path), Pack(norm, dtype, tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", list(MIXED_RHO))
def test_step_of_a_mixed_rho_pack_is_bit_identical_to_todays(norm: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """The same for a pack whose runs differ in rho (read from the per-channel buffer)."""
    rhos = MIXED_RHO[norm]
    today, engine = (Pack(norm, dtype, tmp_path, rhos=rhos) for _ in range(2))
    held = [m.rho_channels for m in engine.model.modules() if isinstance(m, NormFamily)]
    assert held and all(torch.equal(r, torch.tensor(rhos, dtype=torch.float64).repeat_interleave(len(r) // RUNS))
                        for r in held)
    assert_engine_step_is_todays(today, engine)


def test_rates_ahead_leave_the_optimizer_s_tensor_rates_alone() -> None:
    """Under ``trainer.compile`` an optimizer's rates can be 0-d tensors (its compiled step;
    a checkpoint of such a run or a worker's reused pack keeps them), which a schedule writes
    in place: the copy of the schedule that runs ahead writes its own copies, and gives the
    rates the schedule then gives step by step."""
    cfg = compose_cfg(PROTOCOL)
    optimizer = build_optimizer(nn.Linear(3, 2), cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, STEPS_PER_EPOCH)
    optimizer.step()  # the first step's rate as a float, then tensors (AmpCompileWrapper.step)
    scheduler.step()
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
    ahead = LrAhead(scheduler, optimizer).rates(STEPS - 1)
    rates = []
    for _ in range(STEPS - 1):
        rates.append([float(group["lr"]) for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert ahead.tolist() == rates and len({r[0] for r in rates}) == 4


def audit(pack: Pack, step: Callable[[torch.Tensor, torch.Tensor], None]) -> list[str]:
    """What :class:`HostUse` finds in steps 1-4 of ``pack`` (the warmup's rates change each
    step, until step 3), after a first step that creates the momentum."""
    pack.train(step, range(1))
    mode = HostUse(pack.state.device)
    with mode:
        for s in range(1, 5):
            mode.step()
            pack.train(step, range(s, s + 1))
    return mode.problems()


AUDITED = [*(pytest.param(norm, (), id=norm) for norm in NORMS),  # (norm, each run's rho)
           *(pytest.param(norm, rhos, id=f"{norm}-rho{'-'.join(map(str, rhos))}") for norm, rhos in MIXED_RHO.items())]


@pytest.mark.parametrize("norm, rhos", AUDITED)
def test_step_asks_nothing_of_the_host(norm: str, rhos: tuple[float, ...], tmp_path: Path) -> None:
    pack = Pack(norm, torch.float32, tmp_path, rhos=rhos)
    pack.freezer.freeze(pack.state, 1)  # a frozen run's work is in the step too
    step = pack.engine_step()
    assert audit(pack, lambda x, y: step.run()) == []


def test_step_on_the_device_loader_s_draws_asks_nothing_of_the_host(tmp_path: Path) -> None:
    """Under ``data.loader=device`` the step gathers every run's batch, cropped and flipped,
    at its position on the device (:class:`PackedEpochs`): steps 1-4 of an 8-step epoch of a
    pack across rho ask nothing of the host either."""
    pack = Pack("cbn", torch.float32, tmp_path, rhos=MIXED_RHO["cbn"])
    cfg = compose_cfg([*TINY, "data.augment=true", "data.loader=device"])  # 64 images: 8 batches of 8
    loaders = build_seeded_loaders(build_data(cfg.data), cfg.data, 8, list(range(RUNS)), False, CPU)
    assert loaders[0].steps_per_epoch == STEPS_PER_EPOCH
    step = TrainStep(pack.state, pack.net, pack.meter, pack.callbacks, pack.criterion,
                     PackedEpochs([loader.train for loader in loaders]))
    assert audit(pack, lambda x, y: step.run()) == []


def test_host_use_finds_what_a_graph_would_bake_in(tmp_path: Path) -> None:
    """Today's step passes the rate to the update as a Python float, and AMAT's eta as one."""
    pack = Pack("cbn", torch.float32, tmp_path)
    found = audit(pack, pack.todays_step)
    assert len(found) == 1 and "host values" in found[0], found


class ReadsTheLoss(Callback):
    """A bad in-step hook: reads a device value (a Python branch on data needs one)."""

    capturable = True

    def after_backward(self, state: TrainState) -> None:
        if next(state.model.parameters()).grad.sum() > 0:
            pass


class MakesATensor(Callback):
    """A bad in-step hook: a tensor made from a host value each step."""

    capturable = True

    def before_step(self, state: TrainState) -> None:
        torch.tensor(state.lr) * 2


@pytest.mark.parametrize("bad", [ReadsTheLoss, MakesATensor])
def test_host_use_finds_a_bad_step(bad: type[Callback], tmp_path: Path) -> None:
    pack = Pack("bn", torch.float32, tmp_path)
    pack.callbacks.insert(0, bad())
    step = pack.engine_step()
    found = audit(pack, lambda x, y: step.run())
    expected = "waits for a device value" if bad is ReadsTheLoss else "a tensor made from host data"
    assert found and expected in found[0], found


def test_host_use_finds_cpu_tensors_in_a_step_on_another_device() -> None:
    mode = HostUse(torch.device("cuda"))  # the rule for a GPU's step; here every operand is on the CPU
    with mode:
        mode.step()
        torch.ones(3).add_(torch.ones(3))
    assert any("a CPU tensor among its operands" in p for p in mode.problems())


@pytest.mark.slow
def test_whole_step_compiles_to_one_graph_across_lr_changes(tmp_path: Path) -> None:
    """torch.compile(fullgraph=True) of the step's device work for a pack of two runs at rho
    0.5 and 4 (AMAT, batch renormalization with its schedule, BN with 4 things and its pull
    toward 1 and 0, BNP, the frozen-run mask, SGD at the device's rates) traces no graph
    break, and one graph serves the warmup's rates and the milestone's."""
    # In a process of its own: what tracing under trace_autograd_ops (a test-only setting) leaves
    # behind breaks later compiles of an optimizer step in the same process, reset or not.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        rates, graphs = pool.submit(whole_step_compiled, str(tmp_path)).result()
    assert len(set(rates)) >= 4 and graphs[1] == 1 and graphs[-1] == graphs[1]


def whole_step_compiled(folder: str) -> tuple[list[float], list[int]]:
    """The rates of 8 steps and the graphs dynamo made by each, its step compiled whole from
    the second on (:func:`test_whole_step_compiles_to_one_graph_across_lr_changes`)."""
    from torch._dynamo.utils import counters

    cfg = compose_cfg([*PROTOCOL, "schedule.milestones=[5]"])
    models = []
    for rho in (0.5, 4.0):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), CBN2d(4, rho=rho), nn.ReLU(),
                                    nn.Conv2d(4, 4, 3, padding=1),
                                    BatchRenorm2d(4, relax_start=1, r_max_step=6, d_max_step=4),
                                    nn.Conv2d(4, 4, 3, padding=1), FourThingsBN2d(4, ghost_batch=3), nn.Flatten(),
                                    nn.Linear(4 * 36, 10)))
    model = pack_models(models)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, STEPS_PER_EPOCH)
    state = TrainState(cfg, Path(folder), CPU, model, optimizer, scheduler, STEPS_PER_EPOCH, STEPS)
    freezer = FreezeDiverged(RUNS)
    callbacks = [AmatLearningRate(), BnpPreconditioner({"rho": 0.9, "eps1": 1e-2, "eps2": 1e-4}), freezer]
    for cb in callbacks:
        cb.on_train_start(state)
    g = torch.Generator().manual_seed(1)
    data = iter([(torch.randn(8, 3 * RUNS, 6, 6, generator=g), torch.randint(10, (8, RUNS), generator=g))
                 for _ in range(8)])
    step = TrainStep(state, AmpCompileWrapper(model, CPU), TrainMeter(CPU, RUNS), callbacks,
                     lambda logits, y: torch.where(freezer.alive, packed_losses(logits, y), 0.0), data)
    eager, graphs, rates = step.body, [], []
    before = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for s in range(8):
            if s == 1:  # after the step that creates the momentum buffers
                step.body = torch.compile(eager, fullgraph=True, backend="aot_eager")
            rates.append(state.lr)
            step.run()
            scheduler.step()
            state.step += 1
            graphs.append(counters["stats"]["unique_graphs"] - before)
    return rates, graphs




@pytest.mark.parametrize("sampling", ["shuffle", "with_replacement"])
def test_packed_epochs_are_the_runs_batches(sampling: str) -> None:
    """Every run's batches gathered at a device position, resumed mid-epoch and across epochs
    (a shorter last batch under shuffle), are those the device loader yields run by run, packed."""
    cfg = compose_cfg([*TINY, "data.train_size=70", "data.augment=true", "data.loader=device",
                       f"data.sampling={sampling}"])
    bundle = build_data(cfg.data)
    seeds = [0, 1, 2]
    runs = build_seeded_loaders(bundle, cfg.data, 16, seeds, False, CPU)
    plan = PackedEpochs([r.train for r in build_seeded_loaders(bundle, cfg.data, 16, seeds, False, CPU)])
    steps = runs[0].steps_per_epoch
    start = steps + 2  # resumed inside the second epoch
    streams = [r.epochs_from(start) for r in runs]
    position = torch.zeros((), dtype=torch.long)
    for s in range(start, 3 * steps):
        if s == start or s % steps == 0:
            plan.start_epoch(s // steps)
            position.fill_(s % steps)
        want = [next(stream) for stream in streams]
        x, y = plan.batch(position, plan.batch_size_at(s % steps))
        assert torch.equal(x, pack_inputs([w[0] for w in want])) and x.is_contiguous()
        assert torch.equal(y, torch.stack([w[1] for w in want], 1)) and y.is_contiguous()
        position.add_(1)
    assert sampling == "with_replacement" or len(y) < 16


class Float64(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


def test_evaluation_of_a_pack_at_once_gives_todays_rows() -> None:
    """A pack of 3 in float64 over 37 test images in batches of 10 (the last one padded): each
    run's accuracies exactly, its loss to float64 rounding, as the loop over runs and batches."""
    cfg = compose_cfg([*TINY, "data.test_size=37", "data.eval_batch_size=10", "data.loader=device", "norm=cbn"])
    bundle = build_data(cfg.data)
    test = build_seeded_loaders(bundle, cfg.data, 16, [0], False, CPU)[0].test
    models = []
    for run in range(3):
        seed_everything(run)
        models.append(build_model(cfg.model, cfg.norm, cfg.act.name, bundle.spec).double())
    net = AmpCompileWrapper(nn.Sequential(Float64(), pack_models(models)), CPU)
    today = evaluate(net, test, CPU, 10, 3)
    at_once = DeviceEvaluation(net, test, 10, 3)()
    for mine, theirs in zip(at_once, today, strict=True):
        assert mine["test_acc"] == theirs["test_acc"] and mine["test_top5"] == theirs["test_top5"]
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-13, abs=0)


def test_cuda_graph_on_the_cpu_says_so_and_trains_the_same(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    runs = []
    for graph in (False, True):
        with caplog.at_level(logging.WARNING, logger="bnexp.train"):
            train(compose_cfg([*TINY, "norm=cbn", f"trainer.cuda_graph={graph}"]), tmp_path / str(graph))
        runs.append(read_metrics(tmp_path / str(graph) / "metrics.csv"))
    warned = [r.getMessage() for r in caplog.records if "cuda_graph" in r.getMessage()]
    assert len(warned) == 1 and "needs a CUDA device" in warned[0] and "\n" not in warned[0]
    assert [{k: v for k, v in row.items() if k != "seconds"} for row in runs[0]] == \
           [{k: v for k, v in row.items() if k != "seconds"} for row in runs[1]]
