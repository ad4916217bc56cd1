"""bnexp on a CUDA GPU against the CPU (``make gpu-check`` runs these; skipped without a GPU).

Float64 on both devices removes rounding from the comparison, so CUDA and CPU must agree to
1e-10 relative (sums in another order cost a few ulps, 1e-15 each, over at most thousands of
terms). bf16 outputs are compared with the float64 result on the same input by the
rounding bound of tests/test_speed_paths.py.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig
from torch import nn

from bnexp.data.device import draws, pad_crop_flip
from bnexp.models import DataSpec, build_model
from bnexp.nn import BNP, BatchRenorm2d, CBN2d, FourThingsBN2d, NormFamily2d, POPNorm2d, set_learning_rate
from tests.conftest import TINY, compose_cfg, read_summary, run_cli
from tests.test_resilience import EXACT as EXACT_PACK
from tests.test_resilience import CrashAt, assert_same_run, run_inprocess
from tests.test_speed_paths import bound_si
from tests.test_step import AUDITED

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run `make gpu-check` on a GPU")]

CUDA = torch.device("cuda")
RTOL = 1e-10
NORMS: dict[str, Callable[[int], nn.Module]] = {
    "torch_bn": nn.BatchNorm2d, "cbn": CBN2d, "popnorm": POPNorm2d, "brn": BatchRenorm2d, "bn_si": bound_si,
    "decoupled": lambda c: NormFamily2d(c, decouple=True, rho=2.0), "gn": lambda c: nn.GroupNorm(2, c),
    "bn_4things": lambda c: FourThingsBN2d(c, ghost_batch=3, groups=3, alpha=0.2),  # ghost batches of 3, 3 and 2
}
GPU_ON = ["trainer.device=cuda"]
# Deterministic cuBLAS (trainer.deterministic=true) needs this before CUDA starts in this process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def on(device: torch.device | str, norm: nn.Module) -> nn.Module:
    """A copy of ``norm`` on ``device``; ``bn_si`` bound to a copy of its conv there too (the
    conv it reads is not its submodule: in a model the model moves it)."""
    moved = copy.deepcopy(norm).to(device)
    if hasattr(norm, "_op"):
        moved.bind(copy.deepcopy(norm._op[0]).to(device))
    return moved


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=RTOL, atol=RTOL * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("name", NORMS)
def test_norm_on_cuda_equals_cpu_in_float64(name: str) -> None:
    torch.manual_seed(0)
    cpu = on("cpu", NORMS[name](6)).double()
    gpu = on(CUDA, cpu)
    for step in range(3):  # AMAT and running statistics change between steps
        set_learning_rate(cpu, 0.05)
        set_learning_rate(gpu, 0.05)
        x = torch.randn(8, 6, 5, 5, dtype=torch.float64) * 2 + 1
        grad = torch.randn_like(x)
        outs = []
        for module, device in ((cpu, "cpu"), (gpu, CUDA)):
            leaf = x.to(device, copy=True).requires_grad_()  # a leaf on both devices (x itself stays grad-free)
            y = module(leaf)
            y.backward(grad.to(device))
            outs.append((y, leaf.grad))
        close(outs[1][0], outs[0][0])
        close(outs[1][1], outs[0][1])
    for a, b in zip(cpu.state_dict().values(), gpu.state_dict().values()):  # running statistics, AMAT
        if a.is_floating_point():
            close(b, a)
    for a, b in zip(cpu.parameters(), gpu.parameters()):
        close(b.grad, a.grad)


@pytest.mark.parametrize("name", ["cbn", "popnorm", "brn", "bn_si", "decoupled"])
def test_bf16_on_cuda_is_rounded_once(name: str) -> None:
    norm = on(CUDA, NORMS[name](8))
    set_learning_rate(norm, 0.05)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    reference = on(CUDA, norm).double()
    x = (torch.randn(16, 8, 6, 6, device=CUDA) * 0.3 + 3.0).to(torch.bfloat16)
    with torch.no_grad():
        exact = reference(x.double())
        y = norm(x)
    u = torch.finfo(torch.bfloat16).eps / 2
    assert ((y.double() - exact).abs() <= u * exact.abs() + 2.0**-16 * exact.abs().max()).all()


def train_steps(cfg: DictConfig, model: nn.Module, device: torch.device | str, steps: int = 20) -> nn.Module:
    """``steps`` of SGD (momentum, weight decay; BNP when the norm is bnp) on fixed random
    batches, in float64, as the trainer does them."""
    model = model.to(device)
    bnp = BNP(model, **cfg.norm.bnp) if cfg.norm.name == "bnp" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 3, 8, 8, generator=gen, dtype=torch.float64).to(device)
        y = torch.randint(0, 10, (16,), generator=gen).to(device)
        set_learning_rate(model, 0.05)  # CBN's AMAT
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if bnp is not None:
            bnp.step()
        opt.step()
    return model


@pytest.mark.parametrize("norm", ["bn", "cbn", "popnorm", "bnp"])
def test_twenty_training_steps_on_cuda_equal_cpu_in_float64(norm: str) -> None:
    cfg = compose_cfg([*TINY, f"norm={norm}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.norm, cfg.act.name, DataSpec(10, 3, 8)).double()
    cpu = train_steps(cfg, copy.deepcopy(model), "cpu")
    gpu = train_steps(cfg, model, CUDA)
    for a, b in zip(cpu.state_dict().values(), gpu.state_dict().values()):
        if a.is_floating_point():
            close(b, a)


def test_device_loader_augmentation_on_cuda() -> None:
    """Each augmented image is its original, zero-padded by 4, cropped at some offset and
    maybe flipped, and the gather on CUDA equals the CPU's for the same draws."""
    images = torch.rand(16, 3, 8, 8, device=CUDA)
    drawn = draws(16, 4, torch.Generator(CUDA).manual_seed(3))
    out = pad_crop_flip(images, 4, drawn).cpu()
    assert torch.equal(out, pad_crop_flip(images.cpu(), 4, tuple(d.cpu() for d in drawn)))
    padded = nn.functional.pad(images.cpu(), (4, 4, 4, 4))
    for original, augmented in zip(padded, out):
        crops = [original[:, t:t + 8, s:s + 8] for t in range(9) for s in range(9)]
        assert any(torch.equal(augmented, c) or torch.equal(augmented, c.flip(-1)) for c in crops)


def test_compiled_norm_on_cuda_matches_eager() -> None:
    torch.manual_seed(0)
    eager = CBN2d(8).to(CUDA)
    compiled = torch.compile(copy.deepcopy(eager))
    for m in (eager, compiled):
        set_learning_rate(m, 0.05)
    x = torch.randn(16, 8, 6, 6, device=CUDA)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)  # float32: fused reductions reorder sums


def test_resume_on_cuda_is_bit_exact(tmp_path: Path) -> None:
    run_inprocess(tmp_path / "reference", [*GPU_ON, "trainer.max_steps=12"])
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "resumed", [*GPU_ON, "trainer.max_steps=12"], [CrashAt(7)])
    run_inprocess(tmp_path / "resumed", [*GPU_ON, "trainer.max_steps=12"])
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")


def test_compiled_bf16_run_on_cuda_resumes_bit_exactly(tmp_path: Path) -> None:
    """The fast path as gpu-check times it (compiled forward, backward and optimizer step with
    a tensor learning rate, bf16, channels_last), crashed and resumed from its checkpoint."""
    fast = [*GPU_ON, "trainer.max_steps=12", "trainer.compile=true", "trainer.amp=bf16", "trainer.channels_last=true",
            "norm=cbn"]
    run_inprocess(tmp_path / "reference", fast)
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "resumed", fast, [CrashAt(7)])
    run_inprocess(tmp_path / "resumed", fast)
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")


GRAPHED = [*GPU_ON, "trainer.max_steps=14", "trainer.log_every=1", "data.loader=device"]


@pytest.mark.parametrize("norm", ["bn", "cbn", "bnp", "brn", "bn_4things"])
def test_graphed_run_equals_the_plain_run(tmp_path: Path, norm: str) -> None:
    """trainer.cuda_graph: 3 plain steps, the capture, then replays (and the evaluation's own
    graph from its fourth batch, at step 14) write what the plain step writes, bit for bit."""
    extra = ["norm.relax_start=2", "norm.r_max_step=10", "norm.d_max_step=6"] if norm == "brn" else []
    for graph in (False, True):
        run_inprocess(tmp_path / str(graph), [*GRAPHED, f"norm={norm}", *extra, f"trainer.cuda_graph={graph}"])
    assert_same_run(tmp_path / "False", tmp_path / "True")


def test_graphed_run_resumes_bit_exactly(tmp_path: Path) -> None:
    """A resumed run captures its step again (its optimizer state is new tensors) and ends where
    the uninterrupted one ends."""
    graphed = [*GRAPHED, "norm=cbn", "trainer.cuda_graph=true", "trainer.amp=bf16", "trainer.channels_last=true"]
    run_inprocess(tmp_path / "reference", graphed)
    with pytest.raises(RuntimeError):
        run_inprocess(tmp_path / "resumed", graphed, [CrashAt(9)])
    run_inprocess(tmp_path / "resumed", graphed)
    assert_same_run(tmp_path / "reference", tmp_path / "resumed")


def test_graphed_pack_freezes_a_diverged_run_as_the_plain_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in run 1's batch during the replays of a pack across rho (0.5, 1, 4): the run
    diverges and is frozen where the plain pack freezes it (the step is captured again with its
    slot frozen), the others end bit-identical."""
    from bnexp.engine.pack import PackMember, train_pack

    original, drawn = PackMember.next_batch, {"count": 0}

    def poisoned(self: PackMember, swap_rng: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = original(self, swap_rng)
        if self.index == 1:
            drawn["count"] += 1
            if drawn["count"] == 7:  # run 1's 7th batch
                x = x.clone()
                x[0, 0, 0, 0] = float("nan")
        return x, y

    monkeypatch.setattr(PackMember, "next_batch", poisoned)
    overrides = [*TINY, *EXACT_PACK, *GRAPHED, "data.loader=torch", "norm=cbn"]
    for graph in (False, True):
        drawn["count"] = 0
        cfgs = [compose_cfg([*overrides, f"trainer.seed={s}", f"norm.rho={rho}", f"trainer.cuda_graph={graph}"])
                for s, rho in enumerate((0.5, 1.0, 4.0))]
        train_pack(cfgs, [tmp_path / str(graph) / f"seed{s}" for s in range(3)])
    for seed in (0, 2):
        assert_same_run(tmp_path / "False" / f"seed{seed}", tmp_path / "True" / f"seed{seed}")
    outcome = ("status", "steps", "epochs", "final_top1", "final_test_loss", "final_train_loss")
    graphed, plain = (read_summary(tmp_path / graph / "seed1") for graph in ("True", "False"))
    assert graphed["status"] == "diverged"
    assert repr([graphed.get(k) for k in outcome]) == repr([plain.get(k) for k in outcome])  # NaN as NaN


@pytest.mark.parametrize("norm, rhos", AUDITED)
def test_engine_step_has_no_cpu_tensor_and_no_host_read_on_cuda(tmp_path: Path, norm: str,
                                                                 rhos: tuple[float, ...]) -> None:
    """The engine's step on CUDA (a pack with a frozen run, its runs at one rho or each at its
    own, its method hooks, SGD at the device's rates) checked by HostUse after its first step:
    no CPU operand, no host read, no host value that changes between steps."""
    from tests.test_step import Pack, audit

    pack = Pack(norm, torch.float32, tmp_path, CUDA, rhos)
    pack.freezer.freeze(pack.state, 1)
    step = pack.engine_step()
    assert audit(pack, lambda x, y: step.run()) == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs")
@pytest.mark.parametrize("norm", ["bn", "cbn", "bnp"])  # bnp: its one fused all-reduce per step over nccl
def test_two_nccl_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str], norm: str) -> None:
    code, out = run_cli(["train", *[o for o in TINY if not o.startswith("trainer.device")], *GPU_ON,
                         f"norm={norm}", "trainer.nproc=2", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code == 0, out


# ---- ImageNet decoded on the GPU (data.decode=gpu), against the CPU. torchvision's CUDA resize of
# uint8 images computes in float32 and rounds once (within 0.5 level of the exact filter), its CPU
# one and PIL's round after each of two passes (within 1), so CUDA differs from either by at most
# 1 level (torchvision's own tests hold CUDA and CPU to that: test_transforms_v2.py,
# TestResize.test_kernel_image); nvJPEG's images differ from libjpeg-turbo's by under 2 levels
# on average (torchvision's test_image.py, test_decode_jpeg_cuda).


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
@pytest.mark.parametrize("aug", ["cbn", "popnorm"])
def test_imagenet_geometry_on_cuda_equals_cpu(tmp_path: Path, aug: str) -> None:
    """The same decoded image and draws: crops, resizes and flips on CUDA within 1 level of the CPU's."""
    from bnexp.data.imagenet import augment_steps
    from bnexp.data.jpeg import apply_params, decode_with_pil, draw_params, read_encoded
    from bnexp.data.make_imagenet import write_imagenet

    tree = write_imagenet(tmp_path)
    for seed, path in enumerate(sorted(tree.root.rglob("*.JPEG"))):
        encoded = read_encoded(str(path))
        image = decode_with_pil(encoded.data) if encoded.jpeg else encoded.data
        for train in (True, False):
            steps = augment_steps({"aug": aug}, train)
            torch.manual_seed(seed)
            params = draw_params(steps, *encoded.size)
            cpu, gpu = apply_params(steps, image, params), apply_params(steps, image.to(CUDA), params).cpu()
            assert cpu.shape == gpu.shape == (3, 224, 224) and (cpu.int() - gpu.int()).abs().max() <= 1


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
def test_nvjpeg_within_torchvisions_bound(tmp_path: Path) -> None:
    from torchvision.io import ImageReadMode, decode_jpeg

    from bnexp.data.jpeg import read_encoded
    from bnexp.data.make_imagenet import write_imagenet

    jpegs = [e for e in (read_encoded(str(p)) for p in write_imagenet(tmp_path).root.rglob("*.JPEG")) if e.jpeg]
    batched = decode_jpeg([e.data for e in jpegs], mode=ImageReadMode.RGB, device=CUDA)
    for encoded, on_gpu in zip(jpegs, batched, strict=True):
        on_cpu = decode_jpeg(encoded.data, mode=ImageReadMode.RGB)
        assert on_gpu.shape == on_cpu.shape and (on_gpu.cpu().float() - on_cpu.float()).abs().mean() < 2


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
def test_imagenet_decoded_on_cuda_serves_the_cpu_paths_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.decode=gpu training on CUDA against data.decode=cpu on the CPU, the JPEGs decoded by
    PIL for both (nvJPEG has its own test above): the same labels, every value within 1 level."""
    from bnexp.data import build_data, jpeg
    from bnexp.data.imagenet import STD
    from bnexp.data.loaders import build_loaders
    from bnexp.data.make_imagenet import write_imagenet

    def on_cpu_then_cuda(data, mode, device):
        if isinstance(data, list):
            return [jpeg.decode_with_pil(d).to(device) for d in data]
        return jpeg.decode_with_pil(data).to(device)

    monkeypatch.setattr(jpeg, "decode_jpeg", on_cpu_then_cuda)
    tree = write_imagenet(tmp_path, train_per_class=6)
    batches = {}
    for decode, device in (("cpu", torch.device("cpu")), ("gpu", CUDA)):
        cfg = {"name": "imagenet", "root": str(tree.root), "decode": decode, "num_workers": 0, "sampling": "shuffle",
               "eval_batch_size": 4}
        loaders = build_loaders(build_data(cfg), cfg, 5, 0, device.type == "cuda", device)
        torch.manual_seed(0)
        stream = loaders.epochs_from(0)
        batches[decode] = [loaders.to_device(*next(stream)) for _ in range(3)] + list(loaders.test)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    for (xa, ya), (xb, yb) in zip(batches["cpu"], batches["gpu"], strict=True):
        assert xb.device.type == "cuda" and torch.equal(ya, yb.cpu())
        assert ((xa - xb.cpu()) * 255 * std).abs().max() <= 1 + 1e-3
