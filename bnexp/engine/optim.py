"""Optimizer and learning-rate schedule from the ``optim`` and ``schedule`` groups."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
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
    lr_g, lr_w = (cfg["lr"] if cfg.get(key) is None else cfg[key] for key in ("lr_g", "lr_w"))
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
        optimizer = SGD(groups, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0),
                        nesterov=bool(cfg.get("nesterov", False)))
    if len(groups) > 2:
        optimizer.register_step_pre_hook(pull_to_targets)
    return optimizer


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
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(p - group["target"], alpha=group["decay"])


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
