"""The papers' protocols as the presets state them (METHODS.md sections 1, 3 and 7):
POP-Norm's mean-only ablation, BNP's post-activation FC nets, TensorFlow's BN and batch
renorm defaults, Ioffe's renorm schedule, BNP ResNet-110's warmups and initialization."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from bnexp.engine.identity import fingerprint, result_config
from bnexp.engine.optim import build_schedule
from bnexp.models import DataSpec, build_model
from bnexp.nn import BatchRenorm, BatchRenorm1d, FourThingsBN, POPNorm2d
from tests.conftest import TINY, compose_cfg, run_cli


def test_popnorm_mean_only_ablation_divides_by_no_kappa() -> None:
    """Fig. 3's "mean removal only" is eq. 11 alone: no gamma, rho 1 at the paper's lr 0.005, so
    the full-width VGG-16's logits keep a trainable size (with kappa 4 they start near 1e-9)."""
    cfg = compose_cfg(["experiment=popnorm/ablation", "pop_part=mean_only", "act=relu"])
    assert (cfg.norm.rho, cfg.norm.scale, cfg.norm.gamma, cfg.optim.lr) == (1.0, False, False, 0.005)
    assert compose_cfg(["experiment=popnorm/ablation", "pop_part=none"]).optim.lr == 5e-5
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(100, 3, 32))
    norms = [m for m in model.modules() if isinstance(m, POPNorm2d)]
    assert len(norms) == 13 and all(m.rho == 1.0 and not m.scale and not m.gamma for m in norms)
    assert all([name for name, _ in m.named_parameters()] == ["bias"] for m in norms)  # eq. 11 has no gamma
    with torch.no_grad():
        logits = model(torch.rand(8, 3, 32, 32))
    assert logits.std() > 1e-3  # kappa 4 gives ~3e-10 here, rho 1 ~2e-2: the bound sits far from both


def test_norm_gamma_at_true_is_the_fingerprint_of_older_runs() -> None:
    """norm.gamma came after runs were recorded: true (a learnable gamma, what they had) leaves
    the fingerprint as it was; false is another run."""
    cfg = compose_cfg([*TINY, "norm=popnorm"])
    assert cfg.norm.gamma is True and "norm.gamma" not in result_config(cfg)
    assert fingerprint(compose_cfg([*TINY, "norm=popnorm", "norm.gamma=false"])) != fingerprint(cfg)


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
    assert code == 2 and "norm.input='maybe' is not valid: norm.input must be true or false" in out and "Traceback" not in out


def modules_of(cfg, kind: type, size: int = 8) -> list[nn.Module]:
    """The ``kind`` modules of the model ``cfg`` builds for 3 x size x size images."""
    model = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, size))
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("preset", ["bnp/fc", "bnp/cnn5"])
def test_bnp_tensorflow_nets_use_tensorflows_bn_defaults(preset: str) -> None:
    """TF 1.13's BN: moving averages new = 0.99 old + 0.01 batch, eps 1e-3; the PyTorch
    ResNet presets keep PyTorch's 0.1 and 1e-5."""
    size = 32 if preset == "bnp/cnn5" else 8
    bns = modules_of(compose_cfg([f"experiment={preset}", "norm=bn", "trainer.batch_size=128"]),
                     nn.modules.batchnorm._BatchNorm, size)
    assert bns and all((m.eps, m.momentum) == (1e-3, 0.01) for m in bns)
    bn = bns[0].train()
    x = torch.randn(64, bn.num_features, *([3, 3] if isinstance(bn, nn.BatchNorm2d) else [])) + 2.0
    bn(x)
    batch_mean = x.transpose(0, 1).reshape(bn.num_features, -1).mean(1)
    torch.testing.assert_close(bn.running_mean, 0.01 * batch_mean)  # 0.99 * 0 + 0.01 * batch
    ln = modules_of(compose_cfg(["experiment=bnp/fc", "norm=ln", "paper_data=cifar10"]), nn.LayerNorm)
    assert ln and all(m.eps == 1e-3 for m in ln)
    resnet = modules_of(compose_cfg(["experiment=bnp/resnet110", "norm=bn", "model.width=4"]), nn.BatchNorm2d)
    assert resnet and all((m.eps, m.momentum) == (1e-5, 0.1) for m in resnet)


@pytest.mark.parametrize("preset,batch", [("bnp/fc", 6), ("bnp/cnn5", 2)])
def test_bnp_tensorflow_nets_use_tensorflows_batch_renorm(preset: str, batch: int) -> None:
    """TF's default renorm: no clipping at any step, momentum 0.99 (bnexp's 0.01), eps 1e-3."""
    size = 32 if preset == "bnp/cnn5" else 8
    cfg = compose_cfg([f"experiment={preset}", "norm=brn", f"trainer.batch_size={batch}", "paper_data=cifar10"])
    brns = modules_of(cfg, BatchRenorm, size)
    assert brns and all((m.r_max, m.d_max, m.eps, m.momentum) == (None, None, 1e-3, 0.01) for m in brns)
    assert brns[0].limits() == (math.inf, math.inf)


def lrs_at(cfg, steps: list[int], steps_per_epoch: int = 391) -> list[float]:
    """The learning rate of each of ``steps`` under ``cfg``'s optimizer lr and schedule."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    scheduler = build_schedule(optimizer, cfg.schedule, steps_per_epoch)
    out = []
    for step in range(max(steps) + 1):
        if step in steps:
            out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("preset", ["bnp/resnet110", "bnp/preact110"])
def test_bnp_resnet_bn_warms_up_as_he_et_al(preset: str) -> None:
    """BN: lr 0.01 for the first 400 iterations, then 0.1 (a step, not a ramp over an epoch)."""
    got = lrs_at(compose_cfg([f"experiment={preset}", "norm=bn"]), [0, 399, 400, 1000])
    assert got == pytest.approx([0.01, 0.01, 0.1, 0.1], rel=1e-12)


@pytest.mark.parametrize("norm", ["gn", "bnp_gn"])
def test_bnp_resnet_gn_warms_up_linearly_over_one_epoch(norm: str) -> None:
    got = lrs_at(compose_cfg(["experiment=bnp/resnet110", f"norm={norm}"]), [0, 195, 391, 1000], steps_per_epoch=391)
    assert got == pytest.approx([0.01, 0.01 + 0.09 * 195 / 391, 0.1, 0.1], rel=1e-9)


def test_popnorm_kappa_runs_the_protocol_schedule_and_schedule_constant_fixes_the_rate() -> None:
    """POP-Norm Fig. 2's "we fix the learning rate": the preset's reading is the protocol's
    schedule for every kappa (0.1, / 10 at steps 16k and 24k); the register's other reading,
    schedule=constant, keeps 0.1 throughout."""
    steps = [0, 15999, 16000, 24000]
    assert lrs_at(compose_cfg(["experiment=popnorm/kappa"]), steps) == pytest.approx([0.1, 0.1, 0.01, 0.001], rel=1e-9)
    assert lrs_at(compose_cfg(["experiment=popnorm/kappa", "schedule=constant"]), steps) == [0.1] * 4


def he_normal_std(model: nn.Module, fan_in: int) -> tuple[float, float]:
    """The sample std of every 3x3 conv weight with ``fan_in`` inputs, pooled, and He-normal's
    std for that fan-in, sqrt(2 / fan_in)."""
    values = torch.cat([m.weight.detach().flatten() for m in model.modules()
                        if isinstance(m, nn.Conv2d) and m.weight[0].numel() == fan_in])
    return float(values.std()), math.sqrt(2.0 / fan_in)


@pytest.mark.parametrize("preset,scale", [("bnp/resnet110", 0.1), ("bnp/preact110", 0.4)])
def test_bnp_gn_initializes_he_normal_scaled(preset: str, scale: float) -> None:
    """BNP+GN: "He-Normal weight initialization scaled by 0.1" (CIFAR-10) / 0.4 (CIFAR-100);
    the other methods keep He-normal. Over the ~1.3M weights of the 64-channel 3x3 convs the
    sample std's relative standard error is about 1/sqrt(2n) = 0.06 %, so 1 % is 16 of them."""
    torch.manual_seed(0)
    cfg = compose_cfg([f"experiment={preset}", "norm=bnp_gn"])
    got, he = he_normal_std(build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 32)), 64 * 9)
    assert cfg.model.init_scale == scale and got == pytest.approx(scale * he, rel=0.01)
    cfg = compose_cfg([f"experiment={preset}", "norm=gn"])
    got, he = he_normal_std(build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 32)), 64 * 9)
    assert cfg.model.init_scale == 1.0 and got == pytest.approx(he, rel=0.01)


@pytest.mark.parametrize("overrides,message", [
    (["schedule.warmup=1", "schedule.warmup_unit=hour"], "schedule.warmup_unit"),
    (["model.init_scale=0"], "model.init_scale=0"),
    (["norm=brn", "norm.r_max_step=100"], "r_max_step=100 and d_max_step=25000 must not come before relax_start=5000"),
])
def test_bad_warmup_unit_init_scale_or_renorm_schedule_is_one_line(
        overrides: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", *TINY, *overrides], capsys)
    assert code == 2 and message in out and "Traceback" not in out, out


@pytest.mark.parametrize("norm", ["none", "bn", "bnp", "brn", "ln"])
def test_bnp_fc_nets_keep_every_bias(norm: str) -> None:
    """BNP's eq. (2), h = g(W B(h) + b): the normalization after the activation does not
    cancel b, and Appendix B initializes it to zero in every fully connected net."""
    cfg = compose_cfg(["experiment=bnp/fc", f"norm={norm}", "paper_data=cifar10", "trainer.batch_size=6"])
    linears = modules_of(cfg, nn.Linear)
    assert len(linears) == 4 and all(m.bias is not None for m in linears), norm


@pytest.mark.parametrize("groups", ["null", "4"])
def test_bnp_cnn5_bn_4things_keeps_its_biases_and_its_authors_eps(groups: str) -> None:
    """Batch-group normalization pools channel groups, so a conv's per-channel bias is not
    cancelled; the authors' Keras net has one in every conv and dense layer. Its eps and
    momentum are the authors' 1e-5 and 0.01, not TensorFlow's defaults of the other norms."""
    cfg = compose_cfg(["experiment=bnp/cnn5", "norm=bn_4things", "trainer.batch_size=2", f"norm.groups={groups}"])
    ops = modules_of(cfg, nn.Conv2d, 32) + modules_of(cfg, nn.Linear, 32)
    assert len(ops) == 5 and all(m.bias is not None for m in ops)
    norms = modules_of(cfg, FourThingsBN, 32)
    assert norms and all((m.eps, m.momentum) == (1e-5, 0.01) for m in norms)


@pytest.mark.parametrize("overrides,message", [
    (["experiment=bnp/cnn5", "norm=bn", "norm.r_max=3"], "unknown key 'norm.r_max'"),
    (["experiment=bnp/fc", "norm=none", "norm.eps=0.001"], "unknown key 'norm.eps'"),
    (["experiment=bnp/hessian", "norm=bnp", "norm.momentum=0.1"], "unknown key 'norm.momentum'"),
    (["experiment=bnp/cnn5", "norm=brn", "trainer.batch_size=2", "norm.relax_start=100"],
     "relax_start=100 does nothing when r_max=None and d_max=None"),
])
def test_bnp_tensorflow_presets_refuse_settings_a_norm_would_ignore(
        overrides: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The TensorFlow defaults give each norm only the keys its layer reads, and batch renorm
    without clipping has no schedule: a setting that would do nothing is one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", *TINY, *overrides], capsys)
    assert code == 2 and message in out and "Traceback" not in out, out
