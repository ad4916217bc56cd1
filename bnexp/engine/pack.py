"""Packed runs (``trainer.pack``): the seeds of one cell, or of a row's rho or lr grid, trained as one model.

K runs whose configs differ only in their :data:`PER_RUN_KEYS` (``trainer.seed``; rho,
``norm.rho``: CBN's rho, POP-Norm's kappa; the learning rates ``optim.lr``, ``lr_g``,
``lr_w``) are trained in one process as one packed model (:mod:`bnexp.models.packing`; each
run's rho is a per-channel buffer of its channels, so a compiled graph reads it as an input;
runs that differ in their lr each keep their own schedule, :class:`RunSchedules`, whose
rates SGD's device step and adaptive AMAT take per run, under SGD only): run ``k`` keeps its own initial weights (its
model is built right after seeding, as alone), its own batches (its own sampler stream and
augmentation draws: its global random state is swapped in around its batches) and its own
mean loss; the loss differentiated is the sum of the runs' losses, so each run's gradient
is its own, and SGD, weight decay, the schedule and AMAT's learning rate act per element.

The pack is a :class:`PackTrainer`, the engine's :class:`~bnexp.engine.trainer.Trainer` of K
members with the few methods a pack does otherwise: this module is all that a pack adds.
Each run writes its own directory as a run trained alone does (``config.yaml``,
``metrics.csv``, ``weights.csv``, ``summary.json`` with ``packed_with``, periodic
checkpoints and ``checkpoint.pt`` holding that run's state only), so reports, ``bnexp
table`` and a plain ``bnexp train`` of one of the runs see no difference. A pack resumes
from its runs' periodic checkpoints at the newest step all of them hold. A run whose
training loss turns non-finite is marked ``diverged`` where a run alone would be (at the
next finite-loss check) and frozen (:class:`FreezeDiverged`): its loss leaves the sum, and
its parameters and momentum are zeroed and kept at zero while the others go on. A pack
resumed after one of its runs diverged keeps that run, frozen, in its slot (it writes
nothing more): the packed model keeps its shapes, so the others' float rounding, and so
their results, are those of the pack never interrupted.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from bnexp.data import build_data, data_identity
from bnexp.engine import checkpoint
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.config import validate
from bnexp.engine.identity import PER_RUN_KEYS, RATE_KEYS, differences, fingerprint, shared_settings
from bnexp.engine.method_hooks import WeightNormLog, method_callbacks
from bnexp.engine.optim import RunSchedules, build_optimizer, build_schedule, group_rates
from bnexp.engine.pack_size import conv_form
from bnexp.engine.trainer import Member, Trainer, outcome_recorded, setup_summary, total_steps, training_loaders
from bnexp.models import build_model
from bnexp.models.packing import load_packed, pack_inputs, pack_models, pack_state, packed_losses, same_layers, unpack_state
from bnexp.nn.packed import AUTO_CONV, GROUPED, PACK_CONVS
from bnexp.support.distributed import Dist
from bnexp.support.errors import ConfigError
from bnexp.support.runinfo import RunLogFile, configure_backends, resolve_device, seed_everything

log = logging.getLogger("bnexp.engine.pack")

PACK_KEY = "trainer.pack"


@dataclass
class PackMember(Member):
    """A run of a pack: a :class:`~bnexp.engine.trainer.Member` with its own batches, drawn
    under its own random state."""

    rng: dict[str, Any] = field(default_factory=dict)  # its global random state between its batches
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
    frozen: bool = False  # diverged in an earlier process of this pack: holds its slot, writes nothing

    def __post_init__(self) -> None:
        if self.frozen:
            self.status, self.writes = "diverged", False
        super().__post_init__()

    def next_batch(self, swap_rng: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This run's next training batch, drawn under its own random state when the loader
        draws augmentation from the global generators (the DataLoader path)."""
        assert self.stream is not None
        if not swap_rng:
            return next(self.stream)
        outside = checkpoint.capture_rng()
        checkpoint.restore_rng(self.rng)
        try:
            return next(self.stream)
        finally:
            self.rng = checkpoint.capture_rng()
            checkpoint.restore_rng(outside)


def unpackable(cfg: DictConfig) -> list[str]:
    """The settings of ``cfg`` that keep its runs from training as a pack: a pack is one
    process whose probes, logger, fp16 loss scale and resume file its runs would share, and
    random dropout / stochastic-depth masks cannot be drawn per run as alone."""
    unsupported = {
        "trainer.nproc>1": int(cfg.trainer.nproc) > 1,
        "probes": bool(cfg.get("probes")),
        f"logger={cfg.logger.get('name', 'none')}": cfg.logger.get("name", "none") != "none",
        "trainer.amp=fp16": str(cfg.trainer.get("amp")) == "fp16",
        "trainer.resume=<file>": str(cfg.trainer.resume) not in ("auto", "never"),
        "model.dropout": bool(cfg.model.get("dropout")),
        "model.stochastic_depth": bool(cfg.model.get("stochastic_depth")),
        "trainer.init_from": bool(cfg.trainer.get("init_from")),
    }
    return [key for key, on in unsupported.items() if on]


def per_run_values(cfg: DictConfig) -> tuple[Any, ...]:
    """The values of :data:`PER_RUN_KEYS` in ``cfg`` (None for a key it does not have)."""
    return tuple(OmegaConf.select(cfg, key) for key in PER_RUN_KEYS)


def rates(cfg: DictConfig) -> tuple[Any, ...]:
    """The values of :data:`RATE_KEYS` in ``cfg``."""
    return tuple(OmegaConf.select(cfg, key) for key in RATE_KEYS)


def apart(cfg: DictConfig) -> tuple[Any, ...]:
    """What runs of ``cfg``'s settings must also share to train as one pack: their learning
    rates, unless the optimizer takes one per run (SGD's device step); empty then."""
    return () if cfg.optim.name == "sgd" else rates(cfg)


def check_pack(cfgs: Sequence[DictConfig]) -> None:
    """A ConfigError unless ``cfgs`` can train as one pack: the same settings but the
    :data:`PER_RUN_KEYS`, no run twice, and nothing :func:`unpackable`."""
    first = cfgs[0]
    runs = [per_run_values(c) for c in cfgs]
    if len(set(runs)) != len(runs):
        raise ConfigError(f"{PACK_KEY}: the runs of a pack must differ in {' or '.join(PER_RUN_KEYS)}; "
                          f"({', '.join(PER_RUN_KEYS)}) are {runs}")
    common = shared_settings(first)
    for cfg in cfgs[1:]:
        other = shared_settings(cfg)
        if fingerprint(other) != fingerprint(common):
            raise ConfigError(f"{PACK_KEY}: the runs of a pack may differ in {' and '.join(PER_RUN_KEYS)} only; "
                              f"{differences(common, other)}")
    if len({rates(c) for c in cfgs}) > 1 and first.optim.name != "sgd":
        raise ConfigError(f"{PACK_KEY}: the runs of a pack may differ in their learning rates under optim=sgd only "
                          f"(its step takes a rate per run); under optim={first.optim.name} "
                          f"{', '.join(RATE_KEYS)} are {[rates(c) for c in cfgs]}")
    chosen = unpackable(first)
    if chosen:
        raise ConfigError(f"runs cannot train as a pack with {', '.join(chosen)} (a pack is one process whose probes, "
                          "logger, fp16 loss scale and resume file its runs would share, and it cannot draw dropout "
                          "masks per run): train them one at a time (trainer.pack=1, or another hydra/launcher)")


def seeded_models(members: Sequence[PackMember], spec: Any, device: torch.device) -> list[nn.Module]:
    """Each run's model, initialized as the run alone initializes it (seeded first); each
    member keeps the random state right after (from which its augmentation draws)."""
    models = []
    for m in members:
        seed_everything(m.cfg.trainer.seed, m.cfg.trainer.deterministic)
        models.append(build_model(m.cfg.model, m.cfg.norm, m.cfg.act.name, spec).to(device))
        m.rng = checkpoint.capture_rng()
    return models


class FreezeDiverged(Callback):
    """Last of the step's hooks: keeps the slots of diverged runs out of training (their
    :attr:`Member.status` is the record; :meth:`freeze` is called as it is set).
    :meth:`freeze` zeroes a slot's parameters and momentum; after backward its gradients
    are zeroed (:attr:`frozen`, on the host: no sync a step), so SGD keeps it at zero;
    :attr:`alive` takes its loss out of the sum (:meth:`PackTrainer.criterion`). A captured
    step is captured again when :attr:`frozen` changes (:meth:`captured_with`)."""

    capturable = True

    def __init__(self, runs: int, device: torch.device = torch.device("cpu")) -> None:
        self.runs = runs
        self.frozen: list[int] = []
        self.alive = torch.ones(runs, dtype=torch.bool, device=device)  # not frozen, on the loss's device

    def freeze(self, state: TrainState, run: int) -> None:
        self.frozen.append(run)
        self.alive[run] = False
        with torch.no_grad():
            for p in state.model.parameters():  # chunks along dim 0: any memory layout (channels_last)
                p.chunk(self.runs)[run].zero_()
                momentum = state.optimizer.state.get(p, {}).get("momentum_buffer")
                if momentum is not None:
                    momentum.chunk(self.runs)[run].zero_()

    def captured_with(self) -> tuple[int, ...]:
        return tuple(self.frozen)

    def after_backward(self, state: TrainState) -> None:
        if not self.frozen:
            return
        with torch.no_grad():
            for p in state.model.parameters():
                if p.grad is not None:
                    parts = p.grad.chunk(self.runs)
                    for run in self.frozen:
                        parts[run].zero_()


class PackTrainer(Trainer):
    """The :class:`~bnexp.engine.trainer.Trainer` of a pack: what a pack does otherwise."""

    AFTER_DIVERGENCE = "run frozen, the other runs of its pack go on"
    members: list[PackMember]

    def __init__(self, state: TrainState, net: AmpCompileWrapper, members: list[PackMember], loaders: list[Any],
                 num_classes: int, shared: Sequence[Callback]) -> None:
        super().__init__(state, net, list(members), loaders, num_classes, shared)
        self.freezer = FreezeDiverged(len(members), state.device)
        self.callbacks.append(self.freezer)  # last: after every hook that reads or rewrites the gradients
        self.swap_rng = loaders[0].kind == "torch"  # that loader draws augmentation from the global generators

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each run's own batch (a frozen run's too: the pack keeps its shapes), packed."""
        for m, loaders in zip(self.members, self.loaders):
            m.stream = (loaders.to_device(x, y) for x, y in loaders.epochs_from(self.state.step))
        while True:
            batches = [m.next_batch(self.swap_rng) for m in self.members]
            yield pack_inputs([x for x, _ in batches]), torch.stack([y for _, y in batches], 1)

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each run's mean loss, frozen runs' replaced by 0 (their NaN never enters a sum)."""
        return torch.where(self.freezer.alive, packed_losses(logits, y), 0.0)

    def split_state(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        return unpack_state(state, len(self.members))

    def join_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        return pack_state(states)

    def rng_entry(self, member: PackMember) -> list[dict[str, Any]]:
        return [member.rng]

    def restore_rng(self, member: PackMember, entry: list[dict[str, Any]]) -> None:
        member.rng = entry[0]

    def find_checkpoints(self, mode: str) -> list[tuple[Path, dict[str, Any]]] | None:
        """The periodic checkpoints of the newest step that every running member holds (a
        pack resumes with ``auto`` only: :func:`unpackable`); a frozen member's slot is filled
        with the first of them. Any member's later ones are removed: they would outlive the
        ones the pack writes."""
        live = self.running()
        found = common_checkpoints([m.run_dir for m in live])
        start = 0 if found is None else checkpoint_step(found[0][0])
        for m in live:
            for path in checkpoint.periodic_checkpoints(m.run_dir):
                if checkpoint_step(path) > start:
                    log.warning("%s: not resumed from (the pack's other runs hold no checkpoint of step %d); "
                                "removed", path, checkpoint_step(path))
                    path.unlink(missing_ok=True)
                    checkpoint.checksum_path(path).unlink(missing_ok=True)
        if found is None:
            return None
        theirs = iter(found)
        return [next(theirs) if m.status == "running" else found[0] for m in self.members]

    def resume(self, mode: str) -> None:
        """Resume (:meth:`Trainer.resume`), then freeze the slots of the frozen members."""
        super().resume(mode)
        for m in self.members:
            if m.frozen:
                self.freezer.freeze(self.state, m.index)

    def member_lr(self, member: Member, lr: float) -> float:
        schedules = self.state.run_rates
        return lr if schedules is None else schedules.last_lr(member.index)

    def payloads(self) -> list[dict[str, Any]]:
        """As alone (:meth:`Trainer.payloads`), each with its own run's rates and the form of
        the pack's convolutions (what a resume under ``trainer.pack_conv=auto`` keeps)."""
        out = super().payloads()
        for m, payload in zip(self.running(), out):
            if "pack_conv" in m.summary:
                payload["pack_conv"] = m.summary["pack_conv"]
            if self.state.run_rates is not None:
                self.state.run_rates.into_payload(m.index, payload)
        return out

    def restore(self, payloads: list[dict[str, Any]]) -> None:
        """As alone (:meth:`Trainer.restore`), each run's schedule from its own checkpoint."""
        super().restore(payloads)
        if self.state.run_rates is not None:
            self.state.run_rates.restore(payloads, [m.status == "running" for m in self.members])

    def diverge(self, member: Member, lr: float) -> None:
        """As alone (:meth:`Trainer.diverge`), then the run's slot frozen: the others go on."""
        super().diverge(member, lr)
        self.freezer.freeze(self.state, member.index)


def checkpoint_step(path: Path) -> int:
    """The step of a periodic checkpoint, from its name (``step-000000040.pt``)."""
    return int(path.stem.split("-")[1])


def common_checkpoints(run_dirs: Sequence[Path]) -> list[tuple[Path, dict[str, Any]]] | None:
    """Each run's periodic checkpoint at the newest step for which all of them load, or None."""
    names = [{p.name for p in checkpoint.periodic_checkpoints(d)} for d in run_dirs]
    for name in sorted(set.intersection(*names), reverse=True):
        try:
            return [(d / checkpoint.CHECKPOINT_DIR / name, checkpoint.load(d / checkpoint.CHECKPOINT_DIR / name))
                    for d in run_dirs]
        except ValueError as err:
            log.warning("%s; trying an earlier step", err)
    return None


@dataclass
class CompiledPack:
    """The packed model, its compiled wrapper and its optimizer of the last pack this process
    trained with ``trainer.compile``, and the settings they were built with."""

    model: nn.Module
    net: AmpCompileWrapper
    optimizer: torch.optim.Optimizer
    settings: Any


_compiled: list[CompiledPack] = []  # at most one: a worker's graphs, kept for its next pack


def packed_training(cfg: DictConfig, models: Sequence[nn.Module], device: torch.device,
                    conv: str = GROUPED) -> tuple[nn.Module, AmpCompileWrapper, torch.optim.Optimizer]:
    """The packed model of ``models`` under the run's amp / channels_last / compile settings,
    and its optimizer. Compiled, the last pack's objects are reused when this pack has the
    same layers and settings: its runs' values are copied into them (:func:`load_packed`) and
    the optimizer's state is zeroed in place and its learning rates set back, so the graphs
    dynamo traced for them (forward, backward, optimizer step) serve again, with nothing
    recompiled: rho and the runs' weights are tensors the graphs read, not constants. Such a
    pack's first optimizer step is compiled, where a pack on new objects takes it eagerly (it
    creates the optimizer's state): the two differ in the rounding of that step, as compiled
    and eager steps do (docs/speed.md)."""
    model = pack_models(models, conv)
    optim = {k: v for k, v in OmegaConf.to_container(cfg.optim, resolve=True).items() if f"optim.{k}" not in RATE_KEYS}
    settings = (optim, str(cfg.trainer.get("amp")), bool(cfg.trainer.get("channels_last")), str(device), conv)
    last = _compiled.pop() if _compiled else None
    if cfg.trainer.compile and last is not None and last.settings == settings and same_layers(last.model, model):
        load_packed(last.model, model)
        restart_optimizer(last.optimizer, group_rates(cfg.optim, len(last.optimizer.param_groups)))
        _compiled.append(last)
        return last.model, last.net, last.optimizer
    net = AmpCompileWrapper.from_config(model, device, cfg.trainer)
    optimizer = build_optimizer(model, cfg.optim)
    if cfg.trainer.compile:
        _compiled.append(CompiledPack(model, net, optimizer, settings))
    return model, net, optimizer


def restart_optimizer(optimizer: torch.optim.Optimizer, rates: Sequence[float]) -> None:
    """``optimizer`` as it starts a run at ``rates`` (each group's initial lr: a pack of other
    learning rates reuses it too): its state zeroed in place (SGD's first step with a zero
    momentum buffer and Adam's with zero moments and step compute what they compute without
    state), each group's ``lr`` and ``initial_lr`` set to its rate (a schedule built on it
    then starts from them)."""
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
    for group, rate in zip(optimizer.param_groups, rates):
        group["initial_lr"] = rate
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate


def resumed_conv(cfg: DictConfig, members: Sequence[PackMember]) -> str | None:
    """Under ``trainer.pack_conv=auto``, the form of the convolutions a pack being resumed
    was trained with, from its first running run's newest periodic checkpoint, so that it
    continues bit for bit (a new measurement could choose the other form, which rounds
    differently); None for a pack that starts, or a form not recorded."""
    if str(cfg.trainer.get("pack_conv")) != AUTO_CONV or str(cfg.trainer.resume) != "auto":
        return None
    first = next((m for m in members if not m.frozen), None)
    for path in checkpoint.periodic_checkpoints(first.run_dir) if first is not None else []:
        try:
            form = checkpoint.load(path).get("pack_conv")
        except ValueError:
            continue
        if form in PACK_CONVS:
            log.info("trainer.pack_conv=auto: %s, the form this pack trained with before it stopped", form)
            return str(form)
        return None
    return None


def fit_pack(members: list[PackMember]) -> None:
    """Train the runs of ``members`` as one packed model, each writing its own outputs."""
    cfgs = [m.cfg for m in members]
    check_pack(cfgs)
    cfg = cfgs[0]
    backends = configure_backends(cfg.trainer.tf32, cfg.trainer.deterministic)
    device = resolve_device(cfg.trainer.device)
    bundle = build_data(cfg.data)
    one_process = Dist()
    loaders = training_loaders(cfg, bundle, int(cfg.trainer.batch_size), [c.trainer.seed for c in cfgs], device,
                               one_process)
    conv = resumed_conv(cfg, members) or conv_form(cfg, bundle.spec, len(members), device)  # before seeding
    models = seeded_models(members, bundle.spec, device)
    model, net, optimizer = packed_training(cfg, models, device, conv)
    steps_per_epoch = loaders[0].steps_per_epoch
    scheduler = build_schedule(optimizer, cfg.schedule, steps_per_epoch)
    state = TrainState(cfg, members[0].run_dir, device, model, optimizer, scheduler, steps_per_epoch,
                       total_steps(cfg.trainer, steps_per_epoch), train_data=bundle.train)
    run_rates = [group_rates(c.optim, len(optimizer.param_groups)) for c in cfgs]
    if any(r != run_rates[0] for r in run_rates):
        state.run_rates = RunSchedules(cfg.schedule, steps_per_epoch, run_rates)
    setup = dict(backends=backends, data_files=data_identity(cfg.data),
                 **setup_summary(bundle, models[0], device, loaders[0], one_process))
    for m in members:
        m.callbacks = [] if m.frozen else [WeightNormLog(m.run_dir, m.index, len(members))]
        m.summary.update(setup, packed_with=[str(o.run_dir) for o in members if o is not m])
        if str(cfg.trainer.get("pack_conv")) == AUTO_CONV:  # the form auto chose (a given one is in the config)
            m.summary["pack_conv"] = conv
    shared = [cb for cb in method_callbacks(cfg) if not isinstance(cb, WeightNormLog)]  # one for all runs
    PackTrainer(state, net, members, loaders, bundle.spec.num_classes, shared).run()


@contextmanager
def member_logs(members: Sequence[Member]) -> Iterator[None]:
    """The pack's log also in the ``train.log`` of every run but the first (whose file Hydra's
    job logging opens), in the same format; nothing when no log file is open."""
    root = logging.getLogger()
    like = next((h for h in root.handlers if isinstance(h, logging.FileHandler)), None)
    handlers: list[logging.Handler] = []
    for m in [m for m in members[1:] if not m.frozen] if like is not None else []:
        handler = RunLogFile(m.run_dir / "train.log", delay=True)
        handler.setFormatter(like.formatter)
        handler.setLevel(like.level)
        root.addHandler(handler)
        handlers.append(handler)
    try:
        yield
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()


def train_pack(cfgs: Sequence[DictConfig], run_dirs: Sequence[Path],
               frozen: Sequence[bool] = ()) -> list[dict[str, Any]]:
    """Train ``cfgs`` (one per run, in ``run_dirs``) as one pack; returns the summaries of the
    runs not ``frozen`` (runs that diverged in an earlier process of this pack: they hold
    their slots and write nothing). Exceptions are recorded in every run's summary, then
    re-raised."""
    members = [PackMember(i, cfg, run_dir, {}, frozen=i < len(frozen) and frozen[i])
               for i, (cfg, run_dir) in enumerate(zip(cfgs, run_dirs))]
    written = [m for m in members if not m.frozen]
    for m in written:
        m.start()
    with outcome_recorded(written):
        for cfg in cfgs:
            validate(cfg)
        with member_logs(members):
            fit_pack(members)
    return [m.summary for m in written]
