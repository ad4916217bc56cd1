"""Every member of every config group composes into a valid training config."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose
from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra.plugins.config_source import ConfigLoadError
from omegaconf import OmegaConf

from bnexp.app.compose import config_dir, hydra_session
from bnexp.engine.config import validate
from hydra_plugins.bnexp_searchpath import ParsedOnceConfigSource
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


def test_config_files_are_parsed_once_and_each_caller_gets_its_own_copy(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """bnexp's config folders are read through ParsedOnceConfigSource: the same result as
    Hydra's file source, parsed once per content, a fresh copy per load (Hydra edits what it
    loads), and a file parsed again once its content changes, even at the same size."""
    (tmp_path / "norm").mkdir()
    config = tmp_path / "norm" / "x.yaml"
    config.write_text("# @package _global_\nnorm:\n  name: x\n  eps: 0.001\n")
    ours, hydras = ParsedOnceConfigSource("t", str(tmp_path)), FileConfigSource("t", str(tmp_path))
    expected = hydras.load_config("norm/x")
    parses = []
    parse = FileConfigSource.load_config
    monkeypatch.setattr(FileConfigSource, "load_config", lambda self, path: parses.append(path) or parse(self, path))
    first = ours.load_config("norm/x")
    assert first.config == expected.config and first.header == expected.header == {"package": "_global_"}
    first.config.norm.eps = 5.0
    second = ours.load_config("norm/x")
    assert second.config.norm.eps == 0.001 and second.config is not first.config and parses == ["norm/x"]
    config.write_text("# @package _global_\nnorm:\n  name: x\n  eps: 0.002\n")  # the same size
    assert ours.load_config("norm/x").config.norm.eps == 0.002 and parses == ["norm/x", "norm/x"]
    assert (second.provider, second.path) == ("t", f"bnexp-file://{tmp_path}")
    with pytest.raises(ConfigLoadError):
        ours.load_config("norm/missing")
    with hydra_session():
        sources = compose("train", [], return_hydra_config=True).hydra.runtime.config_sources
    assert [(s.provider, s.schema) for s in sources if s.path == str(config_dir())] == [("main", "bnexp-file")]
