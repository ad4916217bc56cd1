"""The papers' protocols as the presets state them (METHODS.md sections 1, 3 and 7):
POP-Norm's mean-only ablation, BNP's post-activation FC nets, TensorFlow's BN and batch
renorm defaults, Ioffe's renorm schedule, BNP ResNet-110's warmups and initialization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bnexp.models import DataSpec, build_model
from bnexp.nn import BatchRenorm1d, POPNorm2d
from tests.conftest import TINY, compose_cfg, run_cli


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


def execution_order(model: nn.Module, x: torch.Tensor) -> list[type]:
    """The classes of the leaf modules a forward runs, in the order it runs them
    (identities and flattening left out)."""
    seen: list[type] = []
    leaves = [m for m in model.modules() if not list(m.children()) and not isinstance(m, (nn.Identity, nn.Flatten))]
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(type(m))) for m in leaves]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("norm,layer", [("bn", nn.BatchNorm1d), ("brn", BatchRenorm1d), ("ln", nn.LayerNorm)])
def test_bnp_fc_nets_normalize_post_activation(norm: str, layer: type) -> None:
    """BNP Figs. 3-4: "normalization is applied post-activation", op -> act -> N in every
    hidden layer: the first Linear reads the raw input, the last a normalized one."""
    cfg = compose_cfg(["experiment=bnp/fc", "paper_data=cifar10", "trainer.batch_size=6", f"norm={norm}"])
    model = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 8)).eval()
    assert execution_order(model, torch.rand(6, 3, 8, 8)) == [nn.Linear, nn.ReLU, layer] * 3 + [nn.Linear]


def test_norm_input_must_be_a_boolean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", *TINY, "norm=cbn", "norm.input=maybe"], capsys)
    assert code == 2 and "norm.input must be true or false, got 'maybe'" in out and "Traceback" not in out
