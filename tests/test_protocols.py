"""The papers' protocols as the presets state them (METHODS.md sections 1, 3 and 7):
POP-Norm's mean-only ablation, BNP's post-activation FC nets, TensorFlow's BN and batch
renorm defaults, Ioffe's renorm schedule, BNP ResNet-110's warmups and initialization."""

from __future__ import annotations

import torch
from torch import nn

from bnexp.models import DataSpec, build_model
from bnexp.nn import POPNorm2d
from tests.conftest import compose_cfg


def test_popnorm_mean_only_ablation_divides_by_no_kappa() -> None:
    """Fig. 3's "mean removal only" is eq. 11 alone: rho 1 at the paper's lr 0.005, so the
    full-width VGG-16's logits keep a trainable size (with kappa 4 they start near 1e-9)."""
    cfg = compose_cfg(["experiment=popnorm/ablation", "pop_part=mean_only", "act=relu"])
    assert (cfg.norm.rho, cfg.norm.scale, cfg.optim.lr) == (1.0, False, 0.005)
    assert compose_cfg(["experiment=popnorm/ablation", "pop_part=none"]).optim.lr == 5e-5
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(100, 3, 32))
    norms = [m for m in model.modules() if isinstance(m, POPNorm2d)]
    assert len(norms) == 13 and all(m.rho == 1.0 and not m.scale for m in norms)
    with torch.no_grad():
        logits = model(torch.rand(8, 3, 32, 32))
    assert logits.std() > 1e-3
