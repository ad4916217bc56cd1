"""Optimizer and learning-rate schedule from the ``optim`` and ``schedule`` groups."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import SGD, Adam, Optimizer
from torch.optim.lr_scheduler import ChainedScheduler, ConstantLR, LinearLR, LRScheduler, MultiStepLR

from bnexp.models.scale_invariance import parameter_groups
from bnexp.nn import FourThingsBN
from bnexp.support.errors import ConfigError, unknown_choice

OPTIMIZERS = ("sgd", "adam")
UNITS = ("epoch", "step")
SCHEDULES = ("multistep", "constant")
WARMUPS = ("constant", "linear")


def build_optimizer(model: nn.Module, cfg: Mapping[str, Any]) -> Optimizer:
    """SGD with momentum (``optim=sgd``) or Adam (``optim=adam``), L2 weight decay added to
    the gradient as torch.optim.SGD and Adam do (Keras's kernel regularizers act the same way).

    Two parameter groups: scale-invariant weights at ``optim.lr_w`` with decay
    ``optim.wd_w``, the rest at ``optim.lr_g`` with ``optim.wd_g`` (defaults: ``optim.lr``
    and ``optim.weight_decay``). Group 0 is the ``lr_g`` group; its lr is the one logged and
    handed to AMAT layers. Setting ``lr_w`` or ``wd_w`` for a model without scale-invariant
    weights is an error: the setting would change nothing. The gamma and beta of BN with 4
    things leave group 0 for groups of their own (:func:`affine_decay_groups`).
    """
    if cfg["name"] not in OPTIMIZERS:
        raise unknown_choice("optim.name", cfg["name"], OPTIMIZERS)
    lr_g, lr_w = base_rates(cfg)
    wd_g, wd_w = (cfg.get("weight_decay", 0.0) if cfg.get(key) is None else cfg[key] for key in ("wd_g", "wd_w"))
    groups = parameter_groups(model, lr_g, lr_w, wd_g, wd_w)
    if not groups[1]["params"]:
        for key in ("lr_w", "wd_w"):
            if cfg.get(key) is not None:
                raise ConfigError(
                    f"optim.{key}={cfg[key]} applies to scale-invariant weights (ops whose output an after_op "
                    "batch normalization divides), and this model has none (the chosen norm or placement makes "
                    f"none): leave optim.{key} unset (null), or use optim.lr / optim.weight_decay")
    groups += affine_decay_groups(model, groups[0])
    if cfg["name"] == "adam":
        optimizer: Optimizer = Adam(groups, lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"])
    else:
        optimizer = DeviceLrSGD(groups, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0),
                                nesterov=bool(cfg.get("nesterov", False)))
    if len(groups) > 2:
        optimizer.register_step_pre_hook(pull_to_targets)
    return optimizer


def base_rates(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """``(lr_g, lr_w)`` of an ``optim`` config: each its own key, ``optim.lr`` where it is unset."""
    lr_g, lr_w = (cfg["lr"] if cfg.get(key) is None else cfg[key] for key in ("lr_g", "lr_w"))
    return lr_g, lr_w


def group_rates(cfg: Mapping[str, Any], groups: int) -> list[float]:
    """The initial lr of each of the ``groups`` parameter groups :func:`build_optimizer` makes
    under ``cfg``: group 1 holds the scale-invariant weights (``lr_w``), every other group
    ``lr_g`` (group 0 and BN-with-4-things' groups, made from group 0)."""
    lr_g, lr_w = base_rates(cfg)
    return [float(lr_w if i == 1 else lr_g) for i in range(groups)]


class DeviceGroup(NamedTuple):
    """The settings of one parameter group that :meth:`DeviceLrSGD.device_step` reads."""

    params: list[Tensor]
    weight_decay: float
    momentum: float
    dampening: float
    nesterov: bool
    decay: float  # pull toward target (affine_decay_groups); 0: none
    target: float


class DeviceLrSGD(SGD):
    """torch.optim.SGD with a second way to step, :meth:`device_step`, whose learning rates
    come from a float64 tensor on the parameters' device (one per group, or per group and run
    of a packed model whose runs differ in their rates; updated in place by
    :class:`bnexp.engine.step.TrainStep`) instead of the groups' floats, so that the step can
    be compiled whole and captured in a CUDA graph (torch's SGD reads a tensor rate on the host
    with ``.item()``). :meth:`step` is torch's own."""

    def prepare_device_step(self) -> None:
        """Take the groups' settings (they stay as they are while training; call again after
        loading a state with other ones): :meth:`device_step` then reads no group dict, whose
        changing ``lr`` would make torch.compile trace it again."""
        if any(group["maximize"] for group in self.param_groups):
            raise ValueError("DeviceLrSGD.device_step does not implement maximize=True")
        self.device_groups = [DeviceGroup(list(g["params"]), g["weight_decay"], g["momentum"], g["dampening"],
                                          g["nesterov"], g.get("decay", 0.0), g.get("target", 0.0))
                              for g in self.param_groups]

    def device_step(self, lr: Tensor) -> None:
        """torch's SGD step with group ``i`` at rate ``lr[i]``, :func:`pull_to_targets` included
        (this step does not go through ``step``'s hooks): decay and momentum as multi-tensor
        calls of the same operations, the update as ``param.addcmul_(d_p, lr, value=-1)``, which
        on the CPU rounds as torch's ``param.add_(d_p, alpha=-lr)`` does (once; ``d_p * lr``
        formed first would round twice). ``lr`` of shape ``(groups, K)`` gives each of the K
        runs of a packed model its own rate (run ``k`` owns the ``k``-th of K blocks of every
        parameter along dim 0, :mod:`bnexp.models.packing`): the same multiplication per
        element. Tells the lr schedule that the optimizer stepped, as the wrapper it puts
        around ``step`` does."""
        with torch.no_grad():
            for group, rate in zip(self.device_groups, lr.unbind()):
                params = [p for p in group.params if p.grad is not None]
                if params:
                    self._device_update(group, params, rate.to(params[0].dtype))
        self._opt_called = True

    def _device_update(self, group: DeviceGroup, params: list[Tensor], lr: Tensor) -> None:
        if group.decay:
            pull_to_target(params, group.decay, group.target)
        grads = [p.grad for p in params]
        if group.weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=group.weight_decay)
        if group.momentum != 0:
            states = [self.state[p] for p in params]
            old = [(s["momentum_buffer"], g) for s, g in zip(states, grads) if "momentum_buffer" in s]
            if old:
                torch._foreach_mul_([b for b, _ in old], group.momentum)
                torch._foreach_add_([b for b, _ in old], [g for _, g in old], alpha=1 - group.dampening)
            for s, g in zip(states, grads):
                if "momentum_buffer" not in s:  # its first step: the buffer starts as the gradient
                    s["momentum_buffer"] = g.detach().clone()
            bufs = [s["momentum_buffer"] for s in states]
            grads = torch._foreach_add(grads, bufs, alpha=group.momentum) if group.nesterov else bufs
        if lr.dim() == 0:
            for p, d_p in zip(params, grads):
                p.addcmul_(d_p, lr, value=-1)
            return
        runs = len(lr)
        for p, d_p in zip(params, grads):  # each run's block of p at its own rate (any memory layout)
            p.unflatten(0, (runs, -1)).addcmul_(d_p.unflatten(0, (runs, -1)), lr.view(runs, *[1] * p.dim()), value=-1)


def affine_decay_groups(model: nn.Module, rest: dict[str, Any]) -> list[dict[str, Any]]:
    """Groups for the gamma and beta of every BN-with-4-things layer, taken out of ``rest``.

    Summers and Dinneen's third thing: an L2 penalty ``d / 2 * (||gamma - 1||^2 +
    ||beta||^2)`` with the layer's ``affine_decay`` ``d``, instead of the run's weight decay
    toward 0. Each group carries ``decay`` and ``target`` (1 for gamma, 0 for beta) and no
    weight decay of its own; :func:`pull_to_targets` adds ``decay * (p - target)`` to the
    gradients before each step. Layers with ``affine_decay = 0`` keep their parameters in
    ``rest``, as any BN's.
    """
    layers = [m for m in model.modules() if isinstance(m, FourThingsBN) and m.affine_decay > 0]
    groups = []
    for decay in sorted({m.affine_decay for m in layers}):
        for attr, target in (("weight", 1.0), ("bias", 0.0)):
            params = [getattr(m, attr) for m in layers if m.affine_decay == decay]
            groups.append({"params": params, "lr": rest["lr"], "weight_decay": 0.0, "decay": decay,
                           "target": target, "name": f"4things_{'gamma' if attr == 'weight' else 'beta'}"})
    taken = {id(p) for g in groups for p in g["params"]}
    rest["params"] = [p for p in rest["params"] if id(p) not in taken]
    return groups


def pull_to_targets(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook: ``grad += decay * (p - target)`` for the groups that carry a ``decay``."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            if group.get("decay"):
                pull_to_target([p for p in group["params"] if p.grad is not None], group["decay"], group["target"])


def pull_to_target(params: list[Tensor], decay: float, target: float) -> None:
    """``p.grad += decay * (p - target)`` for each of ``params`` (under no_grad)."""
    for p in params:
        p.grad.add_(p - target, alpha=decay)


def to_steps(value: float, unit: str, steps_per_epoch: int) -> int:
    """Convert an amount given in ``unit`` (epoch or step) to optimizer steps."""
    if unit not in UNITS:
        raise unknown_choice("unit", unit, UNITS)
    return int(round(value * steps_per_epoch)) if unit == "epoch" else int(value)


def milestone_steps(milestones: list[float], unit: str, steps_per_epoch: int) -> list[int]:
    """The steps at which a multistep schedule decays the lr; a ConfigError when two fall on
    one step (torch's MultiStepLR would decay twice there)."""
    steps = [to_steps(m, unit, steps_per_epoch) for m in milestones]
    if len(set(steps)) < len(steps):
        raise ConfigError(f"schedule.milestones={list(milestones)} is not valid: they fall on the steps {steps} "
                          f"({steps_per_epoch} per epoch), and a step given twice decays the lr twice there: give "
                          "milestones on distinct steps")
    return steps


def build_schedule(optimizer: Optimizer, cfg: Mapping[str, Any], steps_per_epoch: int) -> LRScheduler:
    """A per-step schedule: multistep decay (milestones in epochs or steps) or constant,
    optionally multiplied by a warmup over the first ``warmup`` units (``warmup_unit``,
    default the milestones' ``unit``: He et al.'s 400 steps in an epoch schedule)."""
    name = cfg["name"]
    if name not in SCHEDULES:
        raise unknown_choice("schedule.name", name, SCHEDULES)
    unit = cfg.get("unit", "epoch")
    milestones = milestone_steps(list(cfg.get("milestones") or []), unit, steps_per_epoch) if name == "multistep" else []
    parts: list[LRScheduler] = [MultiStepLR(optimizer, milestones, gamma=cfg.get("gamma", 0.1))]
    warmup_unit = cfg.get("warmup_unit") or unit
    if warmup_unit not in UNITS:
        raise unknown_choice("schedule.warmup_unit", warmup_unit, UNITS)
    warmup = to_steps(cfg.get("warmup", 0), warmup_unit, steps_per_epoch)
    if warmup > 0:
        mode, factor = cfg.get("warmup_mode", "constant"), cfg.get("warmup_factor", 0.1)
        if mode not in WARMUPS:
            raise unknown_choice("schedule.warmup_mode", mode, WARMUPS)
        if mode == "constant":
            parts.append(ConstantLR(optimizer, factor=factor, total_iters=warmup))
        else:
            parts.append(LinearLR(optimizer, start_factor=factor, total_iters=warmup))
    return parts[0] if len(parts) == 1 else ChainedScheduler(parts, optimizer)


class RunSchedules:
    """The lr schedules of the runs of a pack whose runs differ in ``optim.lr`` / ``lr_g`` /
    ``lr_w`` with one schedule shape (:data:`bnexp.engine.identity.PER_RUN_KEYS`): one schedule
    per distinct set of initial rates, each over a stand-in optimizer with those rates (its
    groups hold no parameters), built and stepped as that run's schedule alone is, so its
    rates are the floats the run alone has. The pack's optimizer and schedule keep its first
    run's; :class:`bnexp.engine.step.TrainStep` gives SGD each run's rates (``device_step``),
    and each run's checkpoint holds its own (:meth:`into_payload`)."""

    def __init__(self, cfg: Mapping[str, Any], steps_per_epoch: int, rates: list[list[float]]) -> None:
        distinct = list(dict.fromkeys(tuple(r) for r in rates))
        self.index = [distinct.index(tuple(r)) for r in rates]  # each run's schedule
        self.optimizers = [SGD([{"params": [torch.zeros(0)], "lr": r} for r in group]) for group in distinct]
        for o in self.optimizers:
            o._opt_called = True  # type: ignore[attr-defined]  # as if stepped: no "scheduler before optimizer" warning
        self.schedules = [build_schedule(o, cfg, steps_per_epoch) for o in self.optimizers]
        self.last = self.current()

    def current(self) -> list[float]:
        """Group 0's lr of each schedule now."""
        return [float(o.param_groups[0]["lr"]) for o in self.optimizers]

    def step(self) -> None:
        """After a training step, as the pack's own schedule steps."""
        self.last = self.current()
        for schedule in self.schedules:
            schedule.step()

    def pairs(self) -> list[tuple[LRScheduler, Optimizer]]:
        """Each distinct schedule with its stand-in optimizer."""
        return list(zip(self.schedules, self.optimizers))

    def group_lrs(self, run: int) -> list[float]:
        """Run ``run``'s lr of each parameter group now (the coming step's)."""
        return [float(g["lr"]) for g in self.optimizers[self.index[run]].param_groups]

    def last_lr(self, run: int) -> float:
        """Run ``run``'s group-0 lr of the step just taken (its current one before any)."""
        return self.last[self.index[run]]

    def into_payload(self, run: int, payload: dict[str, Any]) -> None:
        """Run ``run``'s rates into its checkpoint (made from the pack's): its schedule's state
        and its groups' ``lr`` and ``initial_lr``, as the run alone would hold them."""
        own = self.optimizers[self.index[run]].param_groups
        payload["scheduler"] = self.schedules[self.index[run]].state_dict()
        payload["optimizer"] = {**payload["optimizer"], "param_groups": [
            {**g, "lr": mine["lr"], "initial_lr": mine["initial_lr"]}
            for g, mine in zip(payload["optimizer"]["param_groups"], own)]}

    def restore(self, payloads: list[dict[str, Any]], running: list[bool]) -> None:
        """Each schedule from the checkpoint of a run it serves (a running one where there is)."""
        for i, (schedule, optimizer) in enumerate(self.pairs()):
            runs = [k for k, j in enumerate(self.index) if j == i]
            k = next((k for k in runs if running[k]), runs[0])
            schedule.load_state_dict(payloads[k]["scheduler"])
            for g, saved in zip(optimizer.param_groups, payloads[k]["optimizer"]["param_groups"]):
                g["lr"], g["initial_lr"] = float(saved["lr"]), float(saved["initial_lr"])
        self.last = self.current()
