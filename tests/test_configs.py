"""Every member of every config group composes into a valid training config."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from bnexp.app.compose import config_dir
from bnexp.engine.config import validate
from tests.conftest import compose_cfg

GROUPS = ["model", "norm", "act", "data", "optim", "schedule", "trainer"]


def members(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


CASES = [(g, m) for g in GROUPS for m in members(g)]


@pytest.mark.parametrize(("group", "member"), CASES, ids=[f"{g}={m}" for g, m in CASES])
def test_member_composes(group: str, member: str) -> None:
    extra = ["data.path=/nonexistent.npz"] if (group, member) == ("data", "npz") else []
    cfg = compose_cfg([f"{group}={member}", *extra])
    validate(cfg)
    assert OmegaConf.to_container(cfg, resolve=True)[group]
    assert cfg[group].get("name", member) is not None


def test_every_group_has_members() -> None:
    for group in GROUPS:
        assert members(group), group


def test_defaults_are_cbn_cifar_protocol() -> None:
    cfg = compose_cfg([])
    assert (cfg.model.name, cfg.norm.name, cfg.act.name, cfg.data.name) == ("resnet20", "bn", "relu", "cifar10")
    assert cfg.trainer.batch_size == 128 and cfg.trainer.epochs == 120
    assert cfg.data.sampling == "with_replacement" and cfg.data.augment and cfg.data.padding == 4
    assert (cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay) == (0.1, 0.9, 5e-4)
    assert list(cfg.schedule.milestones) == [60, 100] and cfg.schedule.gamma == 0.1
