"""BN with 4 things (Summers and Dinneen 2020) against float64 references written out part by part."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bnexp.engine.optim import build_optimizer
from bnexp.nn import FourThingsBN1d, FourThingsBN2d
from tests.conftest import compose_cfg
from tests.test_nn_misc import gradcheck_module, randomize

DT = torch.float64
EPS = 1e-5
CLASSES = {1: FourThingsBN1d, 2: FourThingsBN2d}
OFF = {"ghost_batch": None, "groups": None, "alpha": 0.0, "affine_decay": 0.0}  # each part at its "off" value


def batch(dim: int, n: int, seed: int, channels: int = 4) -> torch.Tensor:
    """A batch with a different mean and scale per channel."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, channels) if dim == 1 else (n, channels, 2, 3)
    view = (1, channels) if dim == 1 else (1, channels, 1, 1)
    scale = torch.linspace(0.5, 2.0, channels, dtype=DT).view(view)
    shift = torch.linspace(-1.0, 1.5, channels, dtype=DT).view(view)
    return torch.randn(shape, generator=g, dtype=DT) * scale + shift


def training_reference(x, gamma, beta, ghost, cpg):
    """Each ghost batch (consecutive examples; the last may be shorter) and each group of
    ``cpg`` channels normalized by the mean and biased variance of all its values."""
    n, channels = x.shape[:2]
    y = torch.empty_like(x)
    size = n if ghost is None else ghost
    for start in range(0, n, size):
        for c0 in range(0, channels, cpg):
            block = x[start:start + size, c0:c0 + cpg]
            mu = block.mean()
            var = ((block - mu) ** 2).mean()
            for c in range(c0, c0 + cpg):
                y[start:start + size, c] = gamma[c] * (x[start:start + size, c] - mu) / torch.sqrt(var + EPS) + beta[c]
    return y


def eval_reference(x, gamma, beta, mean_pop, sq_pop, alpha, cpg):
    """Per example and channel group: the example's own mean and mean square over the group
    mixed with the population's (averaged over the group's channels) with weight alpha."""
    y = torch.empty_like(x)
    for i in range(x.shape[0]):
        for c0 in range(0, x.shape[1], cpg):
            own = x[i, c0:c0 + cpg]
            m = alpha * own.mean() + (1 - alpha) * mean_pop[c0:c0 + cpg].mean()
            s = alpha * (own ** 2).mean() + (1 - alpha) * sq_pop[c0:c0 + cpg].mean()
            for c in range(c0, c0 + cpg):
                y[i, c] = gamma[c] * (x[i, c] - m) / torch.sqrt(s - m ** 2 + EPS) + beta[c]
    return y


def population_reference(batches, momentum):
    """Moving averages of each batch's per-channel mean and mean square (whole batch)."""
    mean, sq = torch.zeros(4, dtype=DT), torch.ones(4, dtype=DT)
    for x in batches:
        values = x.transpose(0, 1).reshape(4, -1)
        mean = (1 - momentum) * mean + momentum * values.mean(1)
        sq = (1 - momentum) * sq + momentum * (values ** 2).mean(1)
    return mean, sq


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("n,ghost,groups", [
    (6, 2, None),  # (1) ghost batches alone
    (5, 2, None),  # ghost batches that do not divide the batch: the last holds one example
    (6, None, None),  # all off in training: plain BN statistics
    (2, None, 2),  # (2) batch-group normalization: two channels per group over the batch of 2
    (1, None, 2),  # ... down to a batch of one
    (6, 4, 1),  # both: ghost batches of 4 and 2, all channels in one group
])
def test_training_forward_and_population_statistics(dim, n, ghost, groups):
    m = randomize(CLASSES[dim](4, **{**OFF, "ghost_batch": ghost, "groups": groups}, momentum=0.2, eps=EPS).to(DT))
    batches = [batch(dim, n, seed) for seed in range(3)]
    cpg = 1 if groups is None else 4 // groups
    gamma, beta = m.weight.detach(), m.bias.detach()
    for x in batches:
        torch.testing.assert_close(m(x), training_reference(x, gamma, beta, ghost, cpg), rtol=1e-12, atol=1e-12)
    mean, sq = population_reference(batches, 0.2)
    torch.testing.assert_close(m.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.running_sq, sq, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("alpha,groups", [(0.0, None), (0.3, None), (0.3, 2), (1.0, 1)])
def test_inference_example_weighing(dim, alpha, groups):
    """(4): alpha = 0 is BN's inference; alpha > 0 mixes in each example's own statistics."""
    m = randomize(CLASSES[dim](4, **{**OFF, "groups": groups, "alpha": alpha}, momentum=0.5, eps=EPS).to(DT))
    m(batch(dim, 6, 0))
    m(batch(dim, 6, 1))
    m.eval()
    x = batch(dim, 3, 7)
    cpg = 1 if groups is None else 4 // groups
    want = eval_reference(x, m.weight.detach(), m.bias.detach(), m.running_mean, m.running_sq, alpha, cpg)
    torch.testing.assert_close(m(x), want, rtol=1e-12, atol=1e-12)
    if alpha > 0:  # one example's output depends on itself alone, whatever else is in the batch
        torch.testing.assert_close(m(x[:1]), want[:1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
def test_all_four_off_is_batch_norm(dim):
    ours = randomize(CLASSES[dim](4, **OFF, momentum=0.1, eps=EPS).to(DT))
    torch_bn = (nn.BatchNorm1d if dim == 1 else nn.BatchNorm2d)(4, eps=EPS).to(DT)
    torch_bn.load_state_dict({**torch_bn.state_dict(), "weight": ours.weight, "bias": ours.bias})
    for seed in range(3):
        x = batch(dim, 6, seed)
        torch.testing.assert_close(ours(x), torch_bn(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_mean, torch_bn.running_mean, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [1, 2])
def test_gradcheck(dim):
    m = randomize(CLASSES[dim](4, ghost_batch=2, groups=2, alpha=0.25, momentum=0.3).to(DT))
    m(batch(dim, 4, 5))  # population statistics away from their initial values
    x = batch(dim, 5, 3)
    assert gradcheck_module(m, {"weight": m.weight, "bias": m.bias}, x)
    m.eval()
    assert gradcheck_module(m, {"weight": m.weight, "bias": m.bias}, x)


def test_bad_options_name_the_value():
    for options, text in [({"ghost_batch": 0}, "ghost_batch=0"), ({"groups": 3}, "groups=3"),
                          ({"alpha": 1.5}, "alpha must lie in [0, 1]"), ({"affine_decay": -1.0}, "affine_decay")]:
        with pytest.raises(ValueError, match=text.replace("[", r"\[").replace("]", r"\]")):
            FourThingsBN2d(4, **options)


def test_affine_decay_pulls_gamma_to_one_and_beta_to_zero():
    """(3): one SGD step adds ``d (gamma - 1)`` and ``d beta`` to their gradients, and the
    run's weight decay applies to the conv weight alone."""
    torch.manual_seed(0)
    norm = randomize(FourThingsBN2d(4, affine_decay=0.2).to(DT))
    model = nn.Sequential(nn.Conv2d(2, 4, 1, bias=False).to(DT), norm)
    cfg = compose_cfg(["optim.lr=0.5", "optim.momentum=0", "optim.weight_decay=0.01"]).optim
    optimizer = build_optimizer(model, cfg)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model(batch(2, 4, 0, channels=2)).square().sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    want = {"0.weight": before["0.weight"] - 0.5 * (grads["0.weight"] + 0.01 * before["0.weight"]),
            "1.weight": before["1.weight"] - 0.5 * (grads["1.weight"] + 0.2 * (before["1.weight"] - 1.0)),
            "1.bias": before["1.bias"] - 0.5 * (grads["1.bias"] + 0.2 * before["1.bias"])}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-14, atol=1e-14)
    plain = build_optimizer(nn.Sequential(FourThingsBN2d(4, **OFF)), cfg)  # off: gamma, beta as BN's
    assert len(plain.param_groups) == 2 and len(plain.param_groups[0]["params"]) == 2
