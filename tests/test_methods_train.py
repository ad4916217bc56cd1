"""The normalization methods inside the trainer: presets, AMAT's lr, BNP, lr_w/lr_g, weights.csv."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bnexp.app.compose import config_dir
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.optim import build_optimizer
from bnexp.engine.trainer import train
from bnexp.models import DataSpec, build_model
from bnexp.models.scale_invariance import scale_invariant_weights
from bnexp.nn import NormFamily, ScaleInvariantBN
from bnexp.support.errors import ConfigError
from tests.conftest import TINY, compose_cfg, read_summary, run_cli, run_dir_of

PRESETS = sorted(p.stem for p in (config_dir() / "norm").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_completes(tmp_path: Path, capsys: pytest.CaptureFixture[str], preset: str) -> None:
    code, out = run_cli(["train", *TINY, f"norm={preset}", *run_dir_of(tmp_path)], capsys)
    assert code == 0, out
    assert read_summary(tmp_path / "run")["status"] == "completed"


def test_bn_4things_trains_at_batch_1_with_channel_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Batch-group normalization takes its statistics over groups of channels, so a batch of
    one trains (without norm.groups it is refused, as BN is)."""
    code, out = run_cli(["train", *TINY, "norm=bn_4things", "norm.groups=2", "trainer.batch_size=1",
                         *run_dir_of(tmp_path)], capsys)
    assert code == 0, out
    assert read_summary(tmp_path / "run")["status"] == "completed"


class RecordAmatEta(Callback):
    """After each forward (so after before_step handed the lr), read every AMAT layer's eta."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, list[float]]] = []

    def after_backward(self, state: TrainState) -> None:
        etas = [float(m.amat_eta_now) for m in state.model.modules() if isinstance(m, NormFamily) and m.amat]
        self.seen.append((state.lr, etas))


def test_amat_gets_every_steps_lr_through_warmup_and_decay(tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, "norm=cbn", "trainer.max_steps=9", "schedule.unit=step", "schedule.milestones=[6]",
                       "schedule.warmup=3", "schedule.warmup_factor=0.1", "optim.lr=0.05"])
    recorder = RecordAmatEta()
    train(cfg, tmp_path, [recorder])
    lrs = [lr for lr, _ in recorder.seen]
    assert lrs == pytest.approx([0.005] * 3 + [0.05] * 3 + [0.005] * 3)
    for lr, etas in recorder.seen:
        # 19 before-op normalizations and the classifier's (METHODS.md section 1)
        assert len(etas) == 20 and etas == pytest.approx([max(1 - 10 * lr, 0.0)] * 20)


def test_fixed_amat_eta(tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, "norm=cbn", "norm.amat_eta=0.9"])
    model = build_model(cfg.model, cfg.norm, "relu", DataSpec(10, 3, 8))
    layers = [m for m in model.modules() if isinstance(m, NormFamily)]
    assert layers and all(m.amat and m.amat_eta == 0.9 for m in layers)
    with pytest.raises(Exception, match="amat_eta"):
        build_model(cfg.model, {**cfg.norm, "amat_eta": 2.0}, "relu", DataSpec(10, 3, 8))


def test_bnp_rewrites_gradients_in_training(tmp_path: Path) -> None:
    """A BNP run and a plain run with biases start from the same weights and then differ."""
    finals = {}
    for preset in ("bnp", "none"):
        cfg = compose_cfg([*TINY, f"norm={preset}", "norm.op_bias=true", "trainer.max_steps=3"])
        finals[preset] = train(cfg, tmp_path / preset)["final_train_loss"]
    assert finals["bnp"] != finals["none"]
    ckpt = torch.load(tmp_path / "bnp" / "checkpoint.pt", weights_only=False)
    (bnp_state,) = [v for k, v in ckpt["callbacks"].items() if k.endswith("BnpPreconditioner")]
    assert any(k.endswith("sigma2") for k in bnp_state)


def build_tiny(norm: str, **overrides: object) -> nn.Module:
    cfg = compose_cfg([*TINY, f"norm={norm}"])
    norm_cfg = {**cfg.norm, **overrides}
    torch.manual_seed(0)
    return build_model(cfg.model, norm_cfg, "relu", DataSpec(10, 3, 8)).double()


def test_scale_invariant_tags() -> None:
    bn = build_tiny("bn")
    tagged = scale_invariant_weights(bn)
    assert len(tagged) == 19 and all(name.endswith("op.weight") for name, _ in tagged)
    assert scale_invariant_weights(build_tiny("cbn")) == []  # decoupled: beta enters before the division
    assert scale_invariant_weights(build_tiny("bn", placement="before_op")) == []
    assert len(scale_invariant_weights(build_tiny("bn_si"))) == 19


def loss_after_scaling(model: nn.Module, factor: float) -> float:
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.arange(16) % 10
    with torch.no_grad():
        for _, w in scale_invariant_weights(model):
            w.mul_(factor)
        model.train()
        loss = F.cross_entropy(model(x), y).item()
        for _, w in scale_invariant_weights(model):
            w.div_(factor)
    return loss


def test_scaling_tagged_weights_keeps_training_loss() -> None:
    model = build_tiny("bn", eps=1e-30)  # eps -> 0: plain BN is invariant up to its smoothing
    assert loss_after_scaling(model, 3.0) == pytest.approx(loss_after_scaling(model, 1.0), abs=1e-10)


def test_preact_resnet_tags_the_convs_that_feed_a_norm_directly() -> None:
    """In a pre-activation block conv1 -> N2 makes conv1's weight scale-invariant (54 of them
    in ResNet-110); the other convs feed a sum of branches and are not tagged."""
    torch.manual_seed(0)
    cfg = compose_cfg([*TINY, "model=preact_resnet110", "norm=bn", "norm.eps=1e-30"])
    model = build_model(cfg.model, cfg.norm, "relu", DataSpec(10, 3, 8)).double()
    tagged = scale_invariant_weights(model)
    assert [name for name, _ in tagged] == [f"blocks.{i}.conv1.op.weight" for i in range(54)]
    assert loss_after_scaling(model, 3.0) == pytest.approx(loss_after_scaling(model, 1.0), abs=1e-10)
    base = loss_after_scaling(model, 1.0)
    with torch.no_grad():  # an untagged conv (conv2 feeds the residual sum) is not invariant
        model.blocks[0].conv2.weight.mul_(3.0)
    assert abs(loss_after_scaling(model, 1.0) - base) > 1e-4


@pytest.mark.parametrize("overrides", [["norm.placement=before_op"], ["model=preact_resnet110"]])
def test_bn_si_is_refused_where_no_op_produces_the_normalized_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str]) -> None:
    code, out = run_cli(["train", *TINY, "norm=bn_si", *overrides, *run_dir_of(tmp_path)], capsys)
    assert code == 2 and "norm=bn_si smooths each channel with the weight of the op" in out


def test_bn_si_invariant_with_tiny_variance() -> None:
    """Make one channel of the first conv nearly constant: plain BN's eps now matters, bn_si's does not."""
    losses = {}
    for norm in ("bn_si", "bn"):
        model = build_tiny(norm, eps=1e-3)
        with torch.no_grad():
            model.stem.op.weight[0].mul_(1e-4)
        losses[norm] = (loss_after_scaling(model, 3.0), loss_after_scaling(model, 1.0))
    assert losses["bn_si"][0] == pytest.approx(losses["bn_si"][1], abs=1e-10)
    assert abs(losses["bn"][0] - losses["bn"][1]) > 1e-6
    assert isinstance(build_tiny("bn_si").stem.post, ScaleInvariantBN)


def test_lr_w_and_lr_g_groups() -> None:
    cfg = compose_cfg([*TINY, "optim.lr_w=0.5", "optim.lr_g=0.01"])
    model = build_tiny("bn")
    opt = build_optimizer(model, cfg.optim)
    (g, w) = opt.param_groups
    assert (g["lr"], w["lr"]) == (0.01, 0.5)
    assert {id(p) for p in w["params"]} == {id(p) for _, p in scale_invariant_weights(model)}
    assert len(g["params"]) + len(w["params"]) == len(list(model.parameters()))
    defaults = build_optimizer(model, compose_cfg(TINY).optim)
    assert [grp["lr"] for grp in defaults.param_groups] == [0.1, 0.1]
    assert [grp["weight_decay"] for grp in defaults.param_groups] == [5e-4, 5e-4]


def test_weight_decay_per_group_matches_torch_sgd() -> None:
    """optim.wd_w=0 (Arora et al.: decay the scale-variant parameters only): one SGD step
    equals torch's SGD with the two groups written out by hand."""
    cfg = compose_cfg([*TINY, "optim.wd_w=0", "optim.wd_g=1e-3", "optim.lr_w=0.5"])
    model = build_tiny("bn")
    reference = copy.deepcopy(model)
    invariant = {name for name, _ in scale_invariant_weights(model)}
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.arange(8)
    for net, opt in ((model, build_optimizer(model, cfg.optim)),
                     (reference, torch.optim.SGD(
                         [{"params": [p for n, p in reference.named_parameters() if n not in invariant],
                           "lr": 0.1, "weight_decay": 1e-3},
                          {"params": [p for n, p in reference.named_parameters() if n in invariant],
                           "lr": 0.5, "weight_decay": 0.0}], momentum=0.9))):
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), name


def test_adam_has_keras_defaults_and_steps_as_written_out() -> None:
    """optim=adam: Keras's lr 1e-3, beta_1 0.9, beta_2 0.999, epsilon 1e-7; two steps equal
    Adam's update computed by hand in float64 (bias-corrected moments, eps added to sqrt(v_hat))."""
    cfg = compose_cfg([*TINY, "optim=adam"]).optim
    p = nn.Parameter(torch.tensor([0.5, -2.0, 3e-4], dtype=torch.float64))
    opt = build_optimizer(nn.ParameterList([p]), cfg)
    assert type(opt) is torch.optim.Adam
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == [(1e-3, (0.9, 0.999),
                                                                                              1e-7, 0.0)] * 2
    grads = [torch.tensor([0.3, -1e-6, 2.0], dtype=torch.float64), torch.tensor([-0.1, 4.0, 2.0], dtype=torch.float64)]
    want, m, v = p.detach().clone(), torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g**2
        want = want - 1e-3 * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-7)
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), want, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("key", ["lr_w", "wd_w"])
def test_invariant_group_settings_without_invariant_weights_are_errors(key: str) -> None:
    cfg = compose_cfg([*TINY, "norm=none", f"optim.{key}=0.5"])
    with pytest.raises(ConfigError, match=f"optim.{key}=0.5 applies to scale-invariant weights"):
        build_optimizer(build_tiny("none"), cfg.optim)


def test_weights_csv(tmp_path: Path) -> None:
    cfg = compose_cfg([*TINY, "optim.lr_w=0.5", "trainer.eval_every=2", "trainer.eval_unit=step"])
    train(cfg, tmp_path)
    with open(tmp_path / "weights.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["step"] for r in rows} == {"2", "4"} and len(rows) == 2 * 19
    final = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
    for row in rows[19:]:
        norm = final[row["layer"]].double().norm().item()
        assert float(row["weight_norm"]) == pytest.approx(norm, rel=1e-12)
        assert float(row["effective_lr"]) == pytest.approx(0.5 / norm**2, rel=1e-12)
        per_filter = 0.5 / final[row["layer"]].double().flatten(1).square().sum(1)
        for stat in ("min", "median", "max"):
            assert float(row[f"filter_effective_lr_{stat}"]) == pytest.approx(getattr(per_filter, stat)().item(),
                                                                             rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["popnorm", "cbn"])
def test_papers_networks_train_on_real_digits_at_lr_one_tenth(tmp_path: Path, norm: str) -> None:
    """Regression test for the two corrections of METHODS.md (each paper's network form, AMAT
    averaging the current batch in): ResNet-20 with sigmoid at the papers' lr 0.1, momentum
    0.9, weight decay 5e-4, batch 128, on real digits for 10 epochs. Before the corrections
    both collapsed to chance (10 %); 'a wide margin' is five times chance."""
    cfg = compose_cfg(["data=digits", "data.image_size=8", "act=sigmoid", f"norm={norm}", "trainer.epochs=10",
                       "trainer.device=cpu", "trainer.checkpoint_every=0"])
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["final_top1"] >= 5 * 100 / 10
