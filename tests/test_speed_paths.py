"""The fast paths compute what the slow ones do: device loader, channels_last, compile, amp."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torchvision.transforms.v2 import functional as TF

from bnexp.data import build_data
from bnexp.data.arrays import ArrayData, cifar_transforms
from bnexp.data.device import draws, pad_crop_flip
from bnexp.data.loaders import build_loaders, loader_kind
from bnexp.engine import checkpoint
from bnexp.engine.amp_compile import AmpCompileWrapper, amp_mode
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.trainer import train
from bnexp.models import DataSpec, build_model
from bnexp.nn import BNP, BatchRenorm2d, CBN2d, NormFamily2d, POPNorm2d, ScaleInvariantBN2d, set_learning_rate
from bnexp.nn._base import affine, channel_sums, var_mean_per_channel
from bnexp.support.errors import ConfigError
from tests.conftest import TINY, compose_cfg
from tests.test_resilience import CrashAt, assert_same_run, run_inprocess

CPU = torch.device("cpu")
PAD, SIZE = 4, 8


def data_cfg(**kw: object) -> dict:
    return {"name": "synthetic", "num_classes": 10, "image_size": SIZE, "train_size": 40, "test_size": 24,
            "sampling": "with_replacement", "augment": True, "padding": PAD, "num_workers": 0,
            "eval_batch_size": 10, **kw}


def both_loaders(batch: int = 16, **kw: object):
    cfg = data_cfg(**kw)
    bundle = build_data(cfg)
    return (build_loaders(bundle, {**cfg, "loader": "torch"}, batch, 3, False),
            build_loaders(bundle, {**cfg, "loader": "device"}, batch, 3, False, CPU))


def take(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


# -- the device loader ----------------------------------------------------------------------


@pytest.mark.parametrize("sampling", ["with_replacement", "shuffle"])
def test_device_loader_draws_the_same_batches(sampling: str) -> None:
    torch_loaders, device_loaders = both_loaders(sampling=sampling, augment=False)
    assert (torch_loaders.kind, device_loaders.kind) == ("torch", "device")
    assert device_loaders.steps_per_epoch == torch_loaders.steps_per_epoch == 3  # 40 images, batches of 16
    for a, b in zip(take(torch_loaders.epochs_from(0), 7), take(device_loaders.epochs_from(0), 7)):
        (xa, ya), (xb, yb) = torch_loaders.to_device(*a), device_loaders.to_device(*b)  # as the trainer takes them
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for (xa, ya), (xb, yb) in zip(torch_loaders.test, device_loaders.test, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # bit-identical evaluation batches


def test_device_augmentation_is_a_pure_function_of_the_step() -> None:
    _, loaders = both_loaders()
    whole = take(loaders.epochs_from(0), 8)
    resumed = take(loaders.epochs_from(4), 4)
    for (xa, ya), (xb, yb) in zip(whole[4:], resumed):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def coordinate_image() -> torch.Tensor:
    """3 x 8 x 8 uint8: channel 0 holds 10 * (row + 1), channel 1 10 * (col + 1), channel 2 200."""
    rows = torch.arange(1, SIZE + 1).view(-1, 1).expand(SIZE, SIZE)
    return torch.stack([10 * rows, 10 * rows.T, torch.full((SIZE, SIZE), 200)]).to(torch.uint8)


def decode(image: torch.Tensor) -> tuple[int, int, bool]:
    """(top, left, flipped) of a pad-crop(-flip) of :func:`coordinate_image`."""
    i, j = (image[2] > 0).nonzero()[0].tolist()
    top = int(image[0, i, j]) // 10 - 1 + PAD - i
    inside = (image[2, i] > 0).nonzero().flatten().tolist()
    cols = [int(image[1, i, c]) // 10 - 1 for c in inside]
    flipped = cols[1] < cols[0]
    left = cols[0] + PAD - ((SIZE - 1 - inside[0]) if flipped else inside[0])
    return top, left, flipped


def torchvision_draws(n: int) -> list[torch.Tensor]:
    """``n`` draws of the torch path's transform, mapped back from normalized floats to uint8."""
    image = coordinate_image()
    data = ArrayData("coords", image[None].repeat(2, 1, 1, 1), torch.zeros(2, dtype=torch.long), image[None],
                     torch.zeros(1, dtype=torch.long), 1)
    transform = cifar_transforms(data, {"augment": True, "padding": PAD}, train=True)
    mean, std = torch.tensor(data.mean).view(-1, 1, 1), torch.tensor(data.std).view(-1, 1, 1)
    torch.manual_seed(0)
    return [((transform(image) * std + mean) * 255).round().to(torch.uint8) for _ in range(n)]


def device_draws(n: int) -> torch.Tensor:
    return pad_crop_flip(coordinate_image()[None].expand(n, -1, -1, -1), PAD, draws(n, PAD, torch.Generator().manual_seed(0)))


def torchvision_crop(top: int, left: int, flipped: bool) -> torch.Tensor:
    out = TF.crop(TF.pad(coordinate_image(), [PAD]), top, left, SIZE, SIZE)
    return TF.horizontal_flip(out) if flipped else out


def test_device_augmentation_is_torchvisions_crop_and_flip() -> None:
    for image in [*device_draws(50), *torchvision_draws(50)]:
        assert torch.equal(image, torchvision_crop(*decode(image)))


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_device_augmentation_has_torchvisions_distribution() -> None:
    n, cells = 2000, 2 * PAD + 1
    images = {"device": device_draws(n), "torch": torch.stack(torchvision_draws(n))}
    draws = {k: [decode(x) for x in v] for k, v in images.items()}
    offsets = {k: torch.bincount(torch.tensor([t * cells + left for t, left, _ in v]), minlength=cells**2).double()
               for k, v in draws.items()}
    for counts in offsets.values():  # uniform over the 81 offsets: chi2(80) 0.999-quantile is 124.8
        assert chi_square(counts, torch.full_like(counts, n / cells**2)) < 124.8
    pooled = (offsets["device"] + offsets["torch"]) / 2  # two-sample test, same quantile
    assert chi_square(offsets["device"], pooled) + chi_square(offsets["torch"], pooled) < 124.8
    for v in draws.values():  # flip frequency 1/2 within 4 standard errors
        assert abs(sum(f for _, _, f in v) / n - 0.5) < 4 * math.sqrt(0.25 / n)
    device, tv = images["device"].double(), images["torch"].double()  # per-pixel means within 5 standard errors
    spread = (device.var(0) / n + tv.var(0) / n).sqrt()
    assert ((device.mean(0) - tv.mean(0)).abs() <= 5 * spread + 1e-9).all()


def test_loader_choice() -> None:
    bundle = build_data(data_cfg())
    files = dataclasses.replace(bundle, arrays=None)  # as a data set read from files
    cuda = torch.device("cuda")
    assert loader_kind(bundle, {"loader": "auto"}, cuda) == "device"
    assert loader_kind(bundle, {"loader": "auto"}, CPU) == "torch"
    assert loader_kind(files, {"loader": "auto"}, cuda) == "torch"
    with pytest.raises(ConfigError, match="data.loader=device needs an in-memory data set"):
        loader_kind(files, {"loader": "device", "name": "imagenet"}, cuda)
    with pytest.raises(ConfigError, match="unknown data.loader 'gpu'"):
        loader_kind(bundle, {"loader": "gpu"}, CPU)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # fp16 skips overflowing steps
@pytest.mark.parametrize("amp", ["off", "fp16", "bf16"])
def test_resume_with_device_loader_is_bit_identical(tmp_path: Path, amp: str) -> None:
    overrides = ["trainer.max_steps=10", "data.loader=device", f"trainer.amp={amp}", "optim.lr=0.02"]
    run_inprocess(tmp_path / "reference", overrides)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_inprocess(tmp_path / "resumed", overrides, [CrashAt(7)])
    newest = checkpoint.periodic_checkpoints(tmp_path / "resumed")[0]
    assert bool(checkpoint.load(newest)["scaler"]) == (amp == "fp16")  # the GradScaler's state
    summary = run_inprocess(tmp_path / "resumed", overrides)
    assert summary["loader"] == "device" and summary["resumed_from"].endswith("step-000000006.pt")
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")


# -- amp, channels_last, compile ---------------------------------------------------------------


def tiny_resnet() -> nn.Module:
    cfg = compose_cfg(TINY)
    torch.manual_seed(0)
    return build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, SIZE))


def forward_backward(net: AmpCompileWrapper, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = net(x)
    out.square().sum().backward()
    return out.detach(), [p.grad for p in net.model.parameters()]


def assert_grads_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Equal to 1e-5 relative to each gradient's norm (sums over the batch reorder with the layout)."""
    for a, e in zip(actual, expected, strict=True):
        assert (a - e).norm() <= 1e-5 * e.norm(), (a - e).abs().max()


def test_channels_last_matches_default() -> None:
    model = tiny_resnet()
    plain, nhwc = AmpCompileWrapper(model, CPU), AmpCompileWrapper(copy.deepcopy(model), CPU, channels_last=True)
    assert nhwc.model.stem.op.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(6, 3, SIZE, SIZE)
    (ya, ga), (yb, gb) = forward_backward(plain, x), forward_backward(nhwc, x)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    assert_grads_close(gb, ga)
    plain.eval(), nhwc.eval()
    torch.testing.assert_close(nhwc(x), plain(x), rtol=1e-5, atol=1e-5)


def test_compiled_model_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), CBN2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * SIZE * SIZE, 3))
    eager, compiled = AmpCompileWrapper(model, CPU), AmpCompileWrapper(copy.deepcopy(model), CPU, compile=True)
    assert compiled.model.state_dict().keys() == model.state_dict().keys()  # checkpoints see the plain module
    for net in (eager, compiled):
        set_learning_rate(net.model, 0.05)
    for step in range(2):  # the second step runs on the AMAT statistics of the first
        x = torch.randn(6, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(step))
        (ya, ga), (yb, gb) = forward_backward(eager, x), forward_backward(compiled, x)
        torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
        assert_grads_close(gb, ga)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(compiled.model.state_dict()[key], value, rtol=1e-5, atol=1e-5, msg=key)


def small_cbn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), CBN2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * SIZE * SIZE, 3))


def test_compiled_step_matches_eager_and_is_traced_once() -> None:
    """trainer.compile compiles the optimizer step too, its learning rate a tensor: after the
    first two steps (the first, which creates the momentum buffers, runs eagerly; the second
    is traced) the milestone at step 2 changes the rate without a new graph, and the weights
    follow the eager run's (to float32 rounding of reordered sums)."""
    from torch._dynamo.utils import counters

    runs = []
    for compile_ in (False, True):
        net = AmpCompileWrapper(small_cbn_net(), CPU, compile=compile_)
        opt = torch.optim.SGD(net.model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        runs.append((net, opt, torch.optim.lr_scheduler.MultiStepLR(opt, [2], 0.1)))
    for step in range(5):
        x = torch.randn(6, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(step))
        for net, opt, schedule in runs:
            set_learning_rate(net.model, float(opt.param_groups[0]["lr"]))
            opt.zero_grad()
            net.backward(net(x).square().mean(), opt)
            net.step(opt)
            schedule.step()
        if step == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    (eager, eager_opt, _), (compiled, compiled_opt, _) = runs
    assert isinstance(compiled_opt.param_groups[0]["lr"], torch.Tensor)
    assert float(compiled_opt.param_groups[0]["lr"]) == pytest.approx(eager_opt.param_groups[0]["lr"], rel=1e-12)
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_second_optimizer_compiled_in_one_process_steps() -> None:
    """A sweep's next job (or a benchmark's next case) compiles a second optimizer step in the
    same process, for a model with other parameters. Found by ``make gpu-check`` on an H100
    (``bench step`` stopped at its second norm) and reproduced here on the CPU: tracing the
    step that creates the momentum buffers broke dynamo ("speculation log divergence") the
    second time. Both models train, and each matches its eager twin."""
    def model(hidden: int) -> nn.Module:
        torch.manual_seed(hidden)
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(hidden)])

    for hidden in (1, 2):
        nets = [AmpCompileWrapper(model(hidden), CPU, compile=compile_) for compile_ in (False, True)]
        opts = []
        for net in nets:
            params = list(net.model.parameters())  # two groups, as build_optimizer makes them
            opts.append(torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1, momentum=0.9))
        for step in range(3):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            for net, opt in zip(nets, opts):
                opt.zero_grad()
                net.backward(net(x).square().mean(), opt)
                net.step(opt)
        for a, b in zip(nets[0].model.parameters(), nets[1].model.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_compiled_evaluation_is_one_graph_for_every_batch_size() -> None:
    """The last, smaller test batch is padded with zero images (eval mode: each image on
    its own) and the padding's logits dropped, so it needs no graph of its own."""
    from torch._dynamo.utils import counters

    from bnexp.engine.trainer import evaluate

    batches = [(torch.randn(n, 3, SIZE, SIZE), torch.randint(0, 3, (n,))) for n in (4, 4, 3)]
    eager, compiled = AmpCompileWrapper(small_cbn_net(), CPU), AmpCompileWrapper(small_cbn_net(), CPU, compile=True)
    for net in (eager, compiled):
        set_learning_rate(net.model, 0.05)
    evaluate(compiled, batches[:1], CPU, 3)  # traces the eval graph
    graphs = counters["stats"]["unique_graphs"]
    ours, reference = evaluate(compiled, batches, CPU, 3)[0], evaluate(eager, batches, CPU, 3)[0]
    assert counters["stats"]["unique_graphs"] == graphs
    assert ours["test_acc"] == reference["test_acc"]
    assert ours["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)


def test_compiled_models_run_their_own_hooks() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * (SIZE - 2) ** 2, 2))

    x = torch.randn(4, 3, SIZE, SIZE)
    AmpCompileWrapper(model(), CPU, compile=True)(x)  # traced with no hooks at all
    stats = []
    for scale in (1.0, 2.0):  # then two models of the same code, each with its own BNP hooks
        net = model()
        bnp = BNP(net, rho=0.0)
        AmpCompileWrapper(net, CPU, compile=True)(x * scale)
        stats.append(next(bnp.layers()))
    for scale, state in zip((1.0, 2.0), stats):
        assert state.batch_size == 4
        torch.testing.assert_close(state.mu, (x * scale).mean((0, 2, 3)))


class FirstLogits(Callback):
    """Keeps the logits of the run's first training forward, in float32."""

    def on_train_start(self, state: TrainState) -> None:
        self.logits: list[torch.Tensor] = []
        state.model.fc.register_forward_hook(lambda m, args, out: self.logits.append(out.detach().float()))


BF16_ROUNDOFF = 2.0**-9  # unit roundoff of bfloat16's 8 significant bits
RESNET20_DEPTH = 20  # convs and linear on the longest path through ResNet-20


def test_bf16_first_step_is_within_its_rounding_bound(tmp_path: Path) -> None:
    """The same weights and batch under bf16 autocast and in float32.

    Autocast rounds the operands of every conv and linear to bf16 (unit roundoff u = 2^-9)
    and accumulates in float32, so to first order each op's output is off by at most 2u of
    its size; batch normalization after every op rescales the error with the signal, so
    along the D = 20 ops of the longest path the relative errors add up: the logits z are
    off by at most 2 D u max|z|. Cross-entropy's gradient in z is softmax - onehot, of l1
    norm at most 2, so the loss of the first step moves by at most 2 max|dz| (that part is
    exact, so only the logits are checked against the bound). The first-order bound is a
    worst case: over 20 seeds at 1 and 2 threads the largest logit error was 0.35 of it.
    (Later steps are not compared: training amplifies any difference, as between seeds.)
    """
    overrides = [*TINY, "optim.lr=0.02", "trainer.max_steps=1", "trainer.eval_every=1", "trainer.eval_unit=step"]
    logits = {}
    for amp in ("off", "bf16"):
        first = FirstLogits()
        assert train(compose_cfg([*overrides, f"trainer.amp={amp}"]), tmp_path / amp, [first])["status"] == "completed"
        logits[amp] = first.logits[0]
    logit_bound = 2 * RESNET20_DEPTH * BF16_ROUNDOFF * logits["off"].abs().max().item()
    assert (logits["bf16"] - logits["off"]).abs().max().item() <= logit_bound
    assert not torch.equal(logits["bf16"], logits["off"])  # bf16 really was in use


def bound_si(channels: int) -> ScaleInvariantBN2d:
    norm = ScaleInvariantBN2d(channels)
    norm.bind(nn.Conv2d(3, channels, 3, bias=False))
    return norm


@pytest.mark.parametrize("make", [CBN2d, POPNorm2d, BatchRenorm2d, bound_si,
                                  lambda c: NormFamily2d(c, decouple=True, rho=2.0)],
                         ids=["cbn", "popnorm", "brn", "bn_si", "decoupled"])
@pytest.mark.parametrize("training", [True, False])
def test_bf16_output_is_rounded_once(make, training: bool) -> None:
    """A bf16 input of mean 3 and std 0.3 (|mean|/std = 10): every output element, and every
    element of the input's gradient, is the float64 result on the same bf16 input (and
    output gradient), rounded once to bf16 (error <= u |y|, u = 2^-8 for bf16's 8
    significant bits), plus float32 work on operands at most about 11 times the result (a
    few float32 ulps, far below 2^-16 of the largest). Rounding the per-channel shift
    ``beta - a * mean`` to bf16 instead (as this code did) is off by about 10 u at the
    largest outputs, as is torch's BatchNorm2d with bf16 parameters."""
    torch.manual_seed(0)
    norm = make(8)
    set_learning_rate(norm, 0.05)  # CBN's AMAT
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
        norm(torch.randn(16, 8, 6, 6) * 0.3 + 3.0)  # running statistics for eval mode
    norm.train(training)
    reference = copy.deepcopy(norm).double()
    x = (torch.randn(16, 8, 6, 6) * 0.3 + 3.0).to(torch.bfloat16)
    grad = torch.randn(x.shape).to(torch.bfloat16)
    leaves = [x.double().requires_grad_(), x.clone().requires_grad_()]
    exact, y = reference(leaves[0]), norm(leaves[1])
    for out, leaf in zip((exact, y), leaves):
        out.backward(grad.to(out.dtype))
    assert y.dtype == leaves[1].grad.dtype == torch.bfloat16
    u = torch.finfo(torch.bfloat16).eps / 2
    for ours, truth in ((y, exact), (leaves[1].grad, leaves[0].grad)):  # the output, then the input's gradient
        bound = u * truth.abs() + 2.0**-16 * truth.abs().max()
        assert ((ours.detach().double() - truth.detach()).abs() <= bound).all()


def test_norm_statistics_are_float32_under_autocast() -> None:
    x = torch.randn(8, 4, 5, 5).to(torch.bfloat16)
    exact_var, exact_mean = torch.var_mean(x.float(), (0, 2, 3), correction=0)
    norm = NormFamily2d(4, decouple=True, momentum=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16 and norm.running_mean.dtype == torch.float32
    torch.testing.assert_close(norm.running_mean, exact_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(norm.running_var, exact_var * 200 / 199, rtol=1e-6, atol=1e-7)
    conv = nn.Conv2d(4, 2, 1)
    bnp = BNP(nn.Sequential(conv), rho=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv(x)
    state = next(bnp.layers())
    torch.testing.assert_close(state.mu, exact_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state.sigma2, exact_var, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flags", [{}, {"center": False}, {"decouple": True, "rho": 4.0}, {"amat": True},
                                   {"amat": True, "decouple": True, "rho": 0.5},
                                   {"amat": True, "amat_update": "after_forward"},
                                   {"amat": True, "decouple": True, "amat_r_max": 0.95}])
def test_closed_form_backward_matches_autograd_path(flags: dict) -> None:
    # The autograd path serves norm.sync; the closed form serves every other scaled member.
    # Over several AMAT steps (ratios != 1), outputs and all gradients agree in float64.
    torch.manual_seed(0)
    fused = NormFamily2d(3, **flags).double()
    plain = copy.deepcopy(fused)
    plain._fused = lambda: False
    for _ in range(3):
        x = torch.randn(4, 3, 5, 5, dtype=torch.float64) * 2 + 1
        grad = torch.randn_like(x)
        results = []
        for m in (fused, plain):
            set_learning_rate(m, 0.05)
            leaf = x.clone().requires_grad_()
            y = m(leaf)
            m.zero_grad()
            (y * grad).sum().backward()
            results.append((y, leaf.grad, m.weight.grad, m.bias.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(7, 3), (5, 3, 4), (4, 3, 5, 6)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_eager_statistics_kernels_match_the_formulas(shape: tuple[int, ...], channels_last: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3 + 1000  # a large mean: a one-pass formula would fail
    grad = torch.randn(*shape, generator=g)
    if channels_last and x.dim() == 4:
        x, grad = (t.contiguous(memory_format=torch.channels_last) for t in (x, grad))
    dims = [0, *range(2, x.dim())]
    x64, grad64 = x.double(), grad.double()
    mean = x64.mean(dims)
    var = ((x64 - mean.view(1, -1, *[1] * (x.dim() - 2))) ** 2).mean(dims)
    fast_var, fast_mean = var_mean_per_channel(x)  # eager, no gradient: the fast kernels
    torch.testing.assert_close(fast_mean.double(), mean, rtol=0, atol=1e-4)
    torch.testing.assert_close(fast_var.double(), var, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.var_mean(x, dims, correction=0), (fast_var, fast_mean), rtol=1e-5, atol=0)
    leaf = x64.clone().requires_grad_()
    assert torch.autograd.gradcheck(var_mean_per_channel, (leaf,))  # its own backward, in float64
    for kind in (torch.float32, torch.float64):  # one pass of torch's kernel; two reductions
        sum_g, sum_gx = channel_sums(grad, x, kind)
        torch.testing.assert_close(sum_g.double(), grad64.sum(dims), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sum_gx.double(), (grad64 * x64).sum(dims), rtol=1e-5, atol=1e-2)
    a, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
    view = (1, 3, *[1] * (x.dim() - 2))
    torch.testing.assert_close(affine(x, a, b).double(), x64 * a.double().view(view) + b.double().view(view))


@pytest.mark.parametrize("shape, channels_last", [((200000, 4), False), ((8, 4, 256, 256), False),
                                                  ((8, 4, 256, 256), True), ((1, 2, 1024, 1024), False)])
def test_eager_sums_stay_accurate_over_many_terms(shape: tuple[int, ...], channels_last: bool) -> None:
    # 2-D, channels_last and very large planes are where torch's batch-norm kernel adds in
    # float32 serially; these must take torch's own reductions (about 1e-7 here).
    x = torch.rand(*shape, generator=torch.Generator().manual_seed(0)) + 0.5
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    dims = [0, *range(2, x.dim())]
    x64 = x.double()
    sum_x, sum_xx = channel_sums(x, x, torch.float32)
    torch.testing.assert_close(sum_x.double(), x64.sum(dims), rtol=2e-6, atol=0)
    torch.testing.assert_close(sum_xx.double(), (x64 * x64).sum(dims), rtol=2e-6, atol=0)
    var, mean = var_mean_per_channel(x)
    torch.testing.assert_close(var.double(), x64.var(dims, correction=0), rtol=2e-6, atol=0)
    torch.testing.assert_close(mean.double(), x64.mean(dims), rtol=2e-6, atol=0)


def test_amp_setting() -> None:
    assert amp_mode(False) == amp_mode("off") == "off" and amp_mode("bf16") == "bf16"
    with pytest.raises(ConfigError, match="unknown trainer.amp 'fp8'"):
        amp_mode("fp8")
    assert OmegaConf.select(compose_cfg([]), "trainer.amp") == "off"


class HostReads(Callback):
    """Counts the reads of tensor values by the host (``.item()``, ``float()``, ``.tolist()``)
    in training steps 5-15, where no logging, evaluation or checkpoint falls."""

    def after_step(self, state: TrainState) -> None:
        if state.step == 5:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
        if state.step == 15:
            self.profiler.__exit__(None, None, None)
            self.count = sum(e.name == "aten::_local_scalar_dense" for e in self.profiler.events())


@pytest.mark.parametrize("norm", ["bn", "cbn", "popnorm", "brn", "bnp"])
def test_training_steps_never_wait_for_the_device(tmp_path: Path, norm: str) -> None:
    """On a GPU each such read would stall the queue; with the device pipeline a step has none
    (a step that logs, evaluates or checkpoints reads the loss once)."""
    reads = HostReads()
    quiet = ["trainer.max_steps=20", "trainer.log_every=1000", "trainer.eval_every=1000", "trainer.eval_unit=step",
             "data.loader=device", f"norm={norm}"]
    train(compose_cfg([*TINY, *quiet]), tmp_path, [reads])
    assert reads.count == 0
