"""The foundation models in both placements and every activation; the relocation rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bnexp.activations import ACTIVATIONS
from bnexp.models import DataSpec, build_model, count_parameters
from bnexp.models.layers import NormOp, normalized_ops

BN = {"name": "bn", "layer": "batchnorm", "eps": 1e-5, "momentum": 0.1, "op_bias": None}
NONE = {"name": "none", "layer": None, "op_bias": None}
TINY = {"resnet20": {"name": "resnet20", "width": 4}, "vgg16": {"name": "vgg16", "width": 8}}
PLACEMENTS = ["after_op", "before_op"]


def build(model: str, placement: str, act: str = "relu", norm: dict = BN, tiny: bool = True) -> nn.Module:
    cfg = TINY[model] if tiny else {"name": model}
    return build_model(cfg, {**norm, "placement": placement}, act, DataSpec(10, 3, 32 if model == "vgg16" else 8))


@pytest.mark.parametrize("act", ACTIVATIONS.names())
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("model", sorted(TINY))
def test_forward_backward(model: str, placement: str, act: str) -> None:
    torch.manual_seed(0)
    net = build(model, placement, act)
    x = torch.randn(2, 3, 32, 32)
    out = net(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.logsumexp(dim=1).sum().backward()
    grads = [p.grad for p in net.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def channels(op: nn.Module, side: str) -> int:
    if isinstance(op, nn.Conv2d):
        return op.in_channels if side == "in" else op.out_channels
    return op.in_features if side == "in" else op.out_features


@pytest.mark.parametrize("classifier", [True, False])
@pytest.mark.parametrize("model", sorted(TINY))
def test_relocation_rule(model: str, classifier: bool) -> None:
    """The same ops carry a normalization in both placements, plus the classifier in
    before_op with norm.classifier (METHODS.md section 1)."""
    norm = {**BN, "classifier": classifier}
    after, before = (normalized_ops(build(model, p, norm=norm)) for p in PLACEMENTS)
    assert [n for n, _ in after] + (["fc"] if classifier else []) == [n for n, _ in before]
    expected = {"resnet20": 19, "vgg16": 13}[model]
    assert len(after) == expected
    norms = {p: [m for m in build(model, p, norm=norm).modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))]
             for p in PLACEMENTS}
    assert len(norms["after_op"]) == expected and len(norms["before_op"]) == expected + classifier
    for _, unit in after:
        assert isinstance(unit.pre, nn.Identity) and unit.post.num_features == channels(unit.op, "out")
    for _, unit in before:
        assert isinstance(unit.post, nn.Identity) and unit.pre.num_features == channels(unit.op, "in")


def test_before_op_stem_normalizes_input_channels() -> None:
    net = build("resnet20", "before_op", norm={**BN, "classifier": False})
    assert net.stem.pre.num_features == 3 and isinstance(net.fc.pre, nn.Identity)
    net = build("resnet20", "before_op")
    assert isinstance(net.fc.pre, nn.BatchNorm1d) and net.fc.pre.num_features == net.fc.op.in_features == 16


def test_resnet20_parameter_count() -> None:
    assert count_parameters(build("resnet20", "after_op", tiny=False)) == 269_722


def test_no_norm_keeps_biases() -> None:
    net = build("resnet20", "after_op", norm=NONE)
    convs = [m.op for m in net.modules() if isinstance(m, NormOp)]
    assert convs and all(c.bias is not None for c in convs)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in net.modules())


def test_residual_join() -> None:
    """shortcut_after_act: shortcut + act(h); otherwise act(h + shortcut); no act: the sum."""
    from bnexp.models.layers import ResidualJoin

    h, s = torch.tensor([-2.0, 1.0]), torch.tensor([1.0, -3.0])
    assert torch.equal(ResidualJoin(False, nn.ReLU())(h, s), torch.relu(h + s))
    assert torch.equal(ResidualJoin(True, nn.ReLU())(h, s), s + torch.relu(h))
    assert torch.equal(ResidualJoin(True, None)(h, s), h + s)


@pytest.mark.parametrize("join", ["after_act", "before_act"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_residual_block_joins_by_placement_and_norm_join(placement: str, join: str) -> None:
    """A ResNet-20 block: before_op with after_act adds the shortcut after the last
    activation (CBN eq. 7); before_act, and every after_op block, adds it before."""
    net = build("resnet20", placement, act="tanh", norm={**BN, "join": join}).eval()
    block = net.blocks[1]  # identity shortcut
    x = torch.randn(2, 4, 8, 8)
    h = block.conv2(block.act1(block.conv1(x)))
    expected = x + torch.tanh(h) if (placement, join) == ("before_op", "after_act") else torch.tanh(h + x)
    torch.testing.assert_close(block(x), expected)
