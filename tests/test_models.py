"""The model zoo: every model in both placements and every activation, exact parameter counts,
torchvision parity, the relocation rule, before_op joins and classifier normalization, the
norm presets' classes, and the pre-activation ResNet's fixed normalization order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from bnexp.models import MODELS, DataSpec, build_model, count_parameters
from bnexp.models.layers import NormOp, ResidualJoin, normalized_ops
from bnexp.nn import CBN1d, CBN2d, FourThingsBN2d, POPNorm2d, ScaleInvariantBN2d
from bnexp.nn.activations import ACTIVATIONS
from bnexp.nn.create_norm import build_norm_spec, create_norm
from bnexp.nn.renorm import BatchRenorm2d

NORM_DIR = Path(__file__).resolve().parents[1] / "configs" / "norm"


def preset(name: str) -> dict:
    """The ``norm`` preset ``configs/norm/NAME.yaml`` (with its defaults), as a dict."""
    with initialize_config_dir(config_dir=str(NORM_DIR), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name=name), resolve=True)


BN, NONE = preset("bn"), preset("none")
NORMS = [BN, NONE]  # add preset("...") here to run every zoo test with it
PLACEMENTS = ["after_op", "before_op"]

# Small versions with every block type and stage of the paper architectures, and their data.
CIFAR = DataSpec(10, 3, 8)
IMAGENET = DataSpec(10, 3, 32)
MNIST = DataSpec(10, 1, 28)
TINY: dict[str, tuple[dict, DataSpec]] = {
    **{f"resnet{d}": ({"width": 4}, CIFAR) for d in (20, 32, 44, 56, 110)},
    "preact_resnet110": ({"width": 4}, CIFAR),
    "vgg16": ({"width": 8}, DataSpec(10, 3, 32)),
    "resnet18": ({"width": 8}, IMAGENET),
    "resnet50": ({"width": 4}, IMAGENET),
    "efficientnet_b0": ({"width_mult": 0.25}, IMAGENET),
    "mlp3x100": ({"width": 16}, MNIST),
    "mlp2x100": ({"width": 16}, DataSpec(10, 3, 8)),
    "cnn5": ({"width": 8}, MNIST),
}


def tiny(name: str) -> tuple[dict, DataSpec]:
    """A model's tiny settings and data; a model without an entry in TINY (a new one) runs at
    width 4 on CIFAR-sized images, so every registered model is tested without editing this file."""
    return TINY.get(name, ({"width": 4}, CIFAR))


# Normalized ops of each model (the same in both placements).
NORMALIZED = {
    "resnet20": 19, "resnet32": 31, "resnet44": 43, "resnet56": 55, "resnet110": 109, "vgg16": 13,
    "resnet18": 20, "resnet50": 53, "efficientnet_b0": 49, "mlp3x100": 3, "mlp2x100": 2, "cnn5": 4,
}


def build(name: str, norm: dict = BN, placement: str = "after_op", act: str = "relu", **cfg) -> nn.Module:
    model_cfg, data = tiny(name)
    data = cfg.pop("data", data)
    return build_model({"name": name, **model_cfg, **cfg}, {**norm, "placement": placement}, act, data)


def norm_channels(norm: nn.Module) -> int:
    return norm.num_features if hasattr(norm, "num_features") else norm.num_channels


def norm_count(net: nn.Module, norm: dict = BN) -> int:
    """How many normalization modules of the ``norm`` preset ``net`` holds."""
    spec = build_norm_spec(norm)
    kinds = tuple({type(spec.make(8, dim)) for dim in (1, 2)} - {nn.Identity})
    return sum(isinstance(m, kinds) for m in net.modules()) if kinds else 0


def op_channels(op: nn.Module, side: str) -> int:
    if isinstance(op, nn.Conv2d):
        return op.in_channels if side == "in" else op.out_channels
    return op.in_features if side == "in" else op.out_features


def test_the_tables_name_registered_models() -> None:
    """The zoo tests run over the registry (MODELS.names()); TINY and NORMALIZED hold no stale name."""
    assert set(TINY) | set(NORMALIZED) <= set(MODELS.names())


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("norm", NORMS, ids=[n["name"] for n in NORMS])
@pytest.mark.parametrize("name", MODELS.names())
def test_forward_backward(name: str, norm: dict, placement: str) -> None:
    torch.manual_seed(0)
    net = build(name, norm, placement)
    data = tiny(name)[1]
    out = net(torch.randn(2, data.in_channels, data.image_size, data.image_size))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.logsumexp(dim=1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


@pytest.mark.parametrize("name", MODELS.names())
def test_any_input_channels(name: str) -> None:
    """One-channel (MNIST) and three-channel inputs at each model's test size."""
    for channels in (1, 3):
        data = DataSpec(7, channels, tiny(name)[1].image_size)
        net = build(name, placement="before_op", data=data).eval()
        assert net(torch.randn(1, channels, data.image_size, data.image_size)).shape == (1, 7)


@pytest.mark.parametrize(
    ("name", "tv_model", "count"),
    [
        ("resnet18", torchvision.models.resnet18, 11_689_512),
        ("resnet50", torchvision.models.resnet50, 25_557_032),
        ("efficientnet_b0", torchvision.models.efficientnet_b0, 5_288_548),
    ],
)
def test_imagenet_models_match_torchvision(name: str, tv_model, count: int) -> None:
    """Same parameter count, and with torchvision's weights the same eval-mode outputs."""
    torch.manual_seed(0)
    reference = tv_model(weights=None).eval()
    eps = 1e-3 if name.startswith("efficientnet") else 1e-5  # torchvision's EfficientNet BN eps
    ours = build_model({"name": name}, {**BN, "eps": eps}, "swish" if eps == 1e-3 else "relu", DataSpec(1000, 3, 224))
    assert count_parameters(ours) == count_parameters(reference) == count
    mine, theirs = ours.state_dict(), reference.state_dict()
    assert [v.shape for v in mine.values()] == [v.shape for v in theirs.values()]
    ours.load_state_dict(dict(zip(mine, theirs.values())))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), reference(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("depth", "millions"), [(20, 0.27), (32, 0.46), (44, 0.66), (56, 0.85), (110, 1.7)]
)
def test_cifar_resnet_parameter_counts(depth: int, millions: float) -> None:
    count = count_parameters(build_model({"name": f"resnet{depth}"}, BN, "relu", DataSpec(10, 3, 32)))
    assert round(count / 1e6, 1 if depth == 110 else 2) == millions
    if depth == 20:
        assert count == 269_722


@pytest.mark.parametrize("name", sorted(NORMALIZED))
def test_relocation_rule(name: str) -> None:
    """Same normalized ops in both placements, plus the classifier in before_op (the bn
    preset's norm.classifier=true); N has the op's output channels after it and its input
    channels in front of it; a before_op projection shortcut shares its block's N1."""
    after, before = (build(name, placement=p) for p in PLACEMENTS)
    ops_after, ops_before = normalized_ops(after), normalized_ops(before)
    assert [n for n, _ in ops_after] + ["fc"] == [n for n, _ in ops_before]
    assert len(ops_after) == NORMALIZED[name]
    for _, unit in ops_after:
        assert isinstance(unit.pre, nn.Identity) and norm_channels(unit.post) == op_channels(unit.op, "out")
    shared = 0
    for qualified, unit in ops_before:
        assert isinstance(unit.post, nn.Identity)
        norm = unit.pre
        if unit.shares_input_norm:
            assert qualified.endswith(".shortcut")
            norm = before.get_submodule(qualified.rsplit(".", 1)[0]).conv1.pre
            shared += 1
        assert norm_channels(norm) == op_channels(unit.op, "in")
    assert norm_count(after) == len(ops_after)
    assert norm_count(before) == len(ops_before) - shared
    if name == "resnet20":
        assert norm_count(after) == 19 and norm_count(before) == 20


@pytest.mark.parametrize("name", sorted(NORMALIZED))
@pytest.mark.parametrize("classifier", [True, False])
def test_classifier_normalization(name: str, classifier: bool) -> None:
    """norm.classifier puts a 1d normalization of the pooled features in front of the final
    Linear in before_op models only; the Linear keeps its bias either way."""
    for placement in PLACEMENTS:
        fc = build(name, {**BN, "classifier": classifier}, placement).fc
        assert isinstance(fc.op, nn.Linear) and fc.op.bias is not None and isinstance(fc.post, nn.Identity)
        if classifier and placement == "before_op":
            assert isinstance(fc.pre, nn.BatchNorm1d) and fc.pre.num_features == fc.op.in_features
        else:
            assert isinstance(fc.pre, nn.Identity)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "efficientnet_b0"])
@pytest.mark.parametrize("join", ["after_act", "before_act"])
def test_norm_join_reaches_every_residual_block(name: str, join: str) -> None:
    """Every residual join of a before_op model follows norm.join; after_op ones never add
    the shortcut after the activation; EfficientNet's linear bottlenecks have no activation."""
    for placement in PLACEMENTS:
        joins = [m for m in build(name, {**BN, "join": join}, placement).modules() if isinstance(m, ResidualJoin)]
        assert joins
        after_act = placement == "before_op" and join == "after_act"
        assert all(j.shortcut_after_act == after_act for j in joins)
        if name == "efficientnet_b0":
            assert all(isinstance(j.act, nn.Identity) for j in joins)


def test_popnorm_and_cbn_presets_build_their_papers_networks() -> None:
    """POP-Norm: the standard join, no classifier normalization; CBN: eq. 7 and a CBN in
    front of the classifier (METHODS.md section 1)."""
    pop, cbn = (build("resnet20", preset(name), "before_op") for name in ("popnorm", "cbn"))
    assert all(not j.shortcut_after_act for j in pop.modules() if isinstance(j, ResidualJoin))
    assert isinstance(pop.fc.pre, nn.Identity)
    assert all(j.shortcut_after_act for j in cbn.modules() if isinstance(j, ResidualJoin))
    assert type(cbn.fc.pre) is CBN1d and type(cbn.stem.pre) is CBN2d


# The presets that define a method: each builds the class users import, with that class's
# defaults. A flag variant (another YAML file) only has to build.
PRESET_CLASSES = {"bn": nn.BatchNorm2d, "cbn": CBN2d, "popnorm": POPNorm2d, "brn": BatchRenorm2d,
                  "bn_si": ScaleInvariantBN2d, "bn_4things": FourThingsBN2d, "gn": nn.GroupNorm, "ln": nn.GroupNorm,
                  "none": nn.Identity}


@pytest.mark.parametrize("name", sorted(p.stem for p in NORM_DIR.glob("*.yaml")))
def test_each_norm_preset_builds_the_class_users_import(name: str) -> None:
    """norm=NAME builds through the one name -> class map; a method's own preset builds its
    class and restates that class's defaults (the config mirrors the code)."""
    spec = build_norm_spec(preset(name))
    module = spec.make(8, 2)
    if name in PRESET_CLASSES:
        assert type(module) is PRESET_CLASSES[name]
        if spec.layer is not None:
            assert repr(module) == repr(create_norm(spec.layer, 8, 2))


def test_projection_shortcut_reads_the_blocks_normalized_input() -> None:
    net = build("resnet18", placement="before_op").eval()
    block = net.blocks[2]  # first block of stage 2: strided, 1x1 projection
    seen: list[torch.Tensor] = []
    block.shortcut.op.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(2, 8, 8, 8)
    block(x)
    torch.testing.assert_close(seen[0], block.conv1.pre(x))


@pytest.mark.parametrize("norm", NORMS, ids=[n["name"] for n in NORMS])
def test_op_bias_reaches_every_op(norm: dict) -> None:
    """With op_bias true (the BNP presets) every conv and linear of every model has a bias."""
    for name in MODELS.names():
        for placement in PLACEMENTS:
            net = build(name, {**norm, "op_bias": True}, placement)
            ops = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
            assert ops and all(op.bias is not None for op in ops), name


def test_bn_ops_drop_their_bias() -> None:
    """Under bn the normalized ops have no bias; the classifier and squeeze-excitation keep it."""
    net = build("efficientnet_b0")
    assert all(unit.op.bias is None for _, unit in normalized_ops(net))
    unnormalized = [m.op for m in net.modules() if isinstance(m, NormOp) and not m.normalized]
    assert unnormalized and all(op.bias is not None for op in unnormalized)


@pytest.mark.parametrize("norm", NORMS, ids=[n["name"] for n in NORMS])
def test_preact_resnet110_ignores_placement(norm: dict) -> None:
    trees = []
    for placement in PLACEMENTS:
        net = build("preact_resnet110", norm, placement)
        trees.append([(n, type(m).__name__) for n, m in net.named_modules()])
        trees.append([(n, p.shape) for n, p in net.named_parameters()])
        # each block's conv1 feeds its N2 directly: the only op -> N pairs of the model
        expected = [f"blocks.{i}.conv1" for i in range(54)] if build_norm_spec(norm).enabled else []
        assert [name for name, _ in normalized_ops(net)] == expected
    assert trees[0] == trees[2] and trees[1] == trees[3]
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 1 + 2 * 54 + 2  # stem, two per block, two projection shortcuts
    spec = build_norm_spec(norm)
    assert norm_count(net, norm) == (2 * 54 + 1 if spec.enabled else 0)
    assert all((c.bias is not None) == spec.op_bias for c in convs)


def test_preact_block_order() -> None:
    """x + conv2(act(N2(conv1(act(N1(x)))))) for an identity-shortcut block."""
    net = build("preact_resnet110").eval()
    block = net.blocks[1]
    x = torch.randn(2, 4, 8, 8)
    expected = x + block.conv2(torch.relu(block.conv1.post(block.conv1.op(torch.relu(block.norm1(x))))))
    torch.testing.assert_close(block(x), expected)


def test_efficientnet_stochastic_depth_and_squeeze() -> None:
    net = build("efficientnet_b0", width_mult=1.0)
    blocks = [m for m in net.modules() if type(m).__name__ == "MBConv"]
    assert len(blocks) == 16
    assert [b.drop.p for b in blocks] == pytest.approx([0.2 * i / 16 for i in range(16)])
    assert [b.residual for b in blocks].count(True) == 9
    se = blocks[1].block[4]  # expand, act, depthwise, act, SE, project
    assert isinstance(se.act, nn.SiLU) and se.reduce.op.out_channels == 16 // 4
    assert isinstance(blocks[1].block[-1], NormOp)  # the project conv ends the block: no activation


@pytest.mark.parametrize("name", ["mlp3x100", "mlp2x100", "cnn5"])
def test_bnp_nets_glorot_init(name: str) -> None:
    net = build(name, NONE)
    ops = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for op in ops:
        fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(op.weight)
        assert op.weight.abs().max() <= (6 / (fan_in + fan_out)) ** 0.5
        assert torch.count_nonzero(op.bias) == 0


def test_bnp_net_shapes() -> None:
    """Paper sizes: 3 / 2 hidden layers of 100; cnn5 dense input from the image size."""
    data = DataSpec(10, 1, 28)
    mlp3 = build_model({"name": "mlp3x100"}, BN, "relu", data)
    assert [u.op.out_features for _, u in normalized_ops(mlp3)] == [100, 100, 100]
    assert normalized_ops(mlp3)[0][1].op.in_features == 784
    mlp2 = build_model({"name": "mlp2x100"}, BN, "relu", DataSpec(10, 3, 32))
    assert [u.op.in_features for _, u in normalized_ops(mlp2)] == [3072, 100]
    for size, side in ((28, 3), (32, 4)):
        cnn = build_model({"name": "cnn5"}, BN, "relu", DataSpec(10, 3, size))
        convs = [u.op.out_channels for _, u in normalized_ops(cnn)[:3]]
        assert convs == [32, 64, 32] and cnn.dense[0].op.in_features == 32 * side * side
    same = build_model({"name": "cnn5", "padding": "same"}, BN, "relu", DataSpec(10, 3, 32))
    assert same.dense[0].op.in_features == 32 * 8 * 8


@pytest.mark.parametrize("act", ACTIVATIONS.names())
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", ["resnet20", "vgg16"])
def test_every_activation_in_both_placements(name: str, placement: str, act: str) -> None:
    torch.manual_seed(0)
    net = build(name, BN, placement, act)
    data = tiny(name)[1]
    out = net(torch.randn(2, data.in_channels, data.image_size, data.image_size))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.logsumexp(dim=1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_before_op_stem_normalizes_input_channels() -> None:
    net = build("resnet20", {**BN, "classifier": False}, "before_op")
    assert net.stem.pre.num_features == 3 and isinstance(net.fc.pre, nn.Identity)


def test_no_norm_keeps_biases() -> None:
    net = build("resnet20", NONE)
    convs = [m.op for m in net.modules() if isinstance(m, NormOp)]
    assert convs and all(c.bias is not None for c in convs)
    assert not any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) for m in net.modules())


def test_residual_join() -> None:
    """shortcut_after_act: shortcut + act(h); otherwise act(h + shortcut); no act: the sum."""
    h, s = torch.tensor([-2.0, 1.0]), torch.tensor([1.0, -3.0])
    assert torch.equal(ResidualJoin(False, nn.ReLU())(h, s), torch.relu(h + s))
    assert torch.equal(ResidualJoin(True, nn.ReLU())(h, s), s + torch.relu(h))
    assert torch.equal(ResidualJoin(True, None)(h, s), h + s)


@pytest.mark.parametrize("join", ["after_act", "before_act"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_residual_block_joins_by_placement_and_norm_join(placement: str, join: str) -> None:
    """A ResNet-20 block: before_op with after_act adds the shortcut after the last
    activation (CBN eq. 7); before_act, and every after_op block, adds it before."""
    net = build("resnet20", {**BN, "join": join}, placement, "tanh").eval()
    block = net.blocks[1]  # identity shortcut
    x = torch.randn(2, 4, 8, 8)
    h = block.conv2(block.act1(block.conv1(x)))
    expected = x + torch.tanh(h) if (placement, join) == ("before_op", "after_act") else torch.tanh(h + x)
    torch.testing.assert_close(block(x), expected)
