"""The CUDA branches of device choice and RNG checkpointing, run on the CPU with torch.cuda
replaced by a stand-in (the GPU itself is tested by the ``cuda`` tests, tests/test_cuda.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bnexp.app.torchrun import check_gpus
from bnexp.engine import checkpoint
from bnexp.engine.trainer import train
from bnexp.support.errors import ConfigError
from bnexp.support.runinfo import resolve_device
from tests.conftest import TINY, compose_cfg, read_summary


class FakeCuda:
    """torch.cuda as seen by one process: ``count`` visible GPUs, one RNG state each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0) -> None:
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}
        self.current = current
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(cuda, "set_rng_state", self.set_state)
        for name in ("get_rng_state_all", "set_rng_state_all"):  # one state per visible GPU: not portable
            monkeypatch.setattr(cuda, name, lambda *a: pytest.fail(f"torch.cuda.{name} called"))

    def set_state(self, state: torch.Tensor, device: str = "cuda") -> None:
        self.states[self.current] = state.clone()


def test_checkpoint_keeps_the_current_gpus_rng_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved on GPU 5 of 8 (a torchrun rank), restored where one GPU is visible."""
    eight = FakeCuda(monkeypatch, count=8, current=5)
    state = checkpoint.capture_rng()
    assert torch.equal(state["cuda"], torch.tensor([5], dtype=torch.uint8))
    one = FakeCuda(monkeypatch, count=1)
    checkpoint.restore_rng(state)
    assert torch.equal(one.states[0], torch.tensor([5], dtype=torch.uint8)) and eight.states[5][0] == 5


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [(8, 3, 3), (1, 3, 0), (1, 0, 0), (2, 1, 1)])
def test_torchrun_rank_picks_a_visible_gpu(monkeypatch: pytest.MonkeyPatch, visible: int, local_rank: int,
                                           expected: int) -> None:
    """One GPU bound per task (SLURM): every rank uses the one it sees."""
    FakeCuda(monkeypatch, count=visible)
    assert resolve_device("cuda", local_rank) == torch.device("cuda", expected)


def test_more_ranks_than_gpus_is_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, count=2)
    with pytest.raises(ConfigError, match="process of local rank 2 sees 2 GPUs"):
        resolve_device("cuda", 2)
    FakeCuda(monkeypatch, count=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # SLURM, one GPU bound to each of 4 tasks: each uses its own
    assert resolve_device("cuda", 3) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="trainer.nproc=2 processes need a GPU each and this machine shows 1"):
        check_gpus(2, "auto")  # bnexp's own launcher, before torchrun starts
    check_gpus(2, "cpu")


def test_checkpoint_of_every_visible_gpu_still_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint written before 2026-11-23 holds one RNG state per visible GPU."""
    fake = FakeCuda(monkeypatch, count=2, current=1)
    state = checkpoint.capture_rng()
    state["cuda"] = [torch.tensor([7], dtype=torch.uint8), torch.tensor([9], dtype=torch.uint8)]
    checkpoint.restore_rng(state)
    assert fake.states[1][0] == 9


@pytest.mark.parametrize(("tf32", "deterministic"), [(True, False), (False, True)])
def test_tf32_and_cudnn_benchmark_follow_the_config(tmp_path: Path, tf32: bool, deterministic: bool) -> None:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        cfg = compose_cfg([*TINY, "trainer.max_steps=2", f"trainer.tf32={tf32}", f"trainer.deterministic={deterministic}"])
        summary = train(cfg, tmp_path / "run")
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
        assert torch.backends.cudnn.benchmark is (not deterministic)
        assert summary["backends"] == {"tf32": tf32, "cudnn_benchmark": not deterministic}
        assert read_summary(tmp_path / "run")["backends"]["tf32"] is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


def test_gpu_check_plans_every_check_and_summarizes_them() -> None:
    from bnexp.bench.gpu_check import checks, markdown

    assert [s.name for s in checks(False)] == ["tests"]
    plan = {s.name: s.command for s in checks(True)}
    assert list(plan) == ["tests", "step-graph", "table-cost", "imagenet-input", "bench-norms", "bench-step", "bench-data",
                          "bench-pack", "bench-run", "resnet20-bn", "resnet20-cbn", "resnet20-cbn-pack10"]
    assert {"trainer.pack=10", "norm=cbn", "target_seconds=180"} <= set(plan["resnet20-cbn-pack10"])
    assert all("device=cuda" in command for name, command in plan.items() if name != "tests")
    assert {"trainer.amp=bf16", "trainer.channels_last=true", "trainer.compile=true", "norm=cbn"} <= set(
        plan["resnet20-cbn"])
    report = {"date": "2026-11-23", "device": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0", "python": "3.12",
              "checks": [{"name": "tests", "ok": True, "seconds": 60.0, "budget_s": 130},
                         {"name": "bench-run", "ok": False, "seconds": 300.0, "budget_s": 60}],
              "extrapolated_minutes": {"bn": 1.9},
              "benchmarks": {"bench-run": [{"name": "run", "mode": "eager", "seconds_median": 2.0, "ratio": 1.1}],
                             "step-graph": [{"name": "bn", "amp": "bf16", "mode": "replayed vs plain", "steps": 24,
                                             "max_difference": 0.0},
                                            {"name": "bn", "amp": "bf16", "mode": "graph", "ms_per_step": 1.61,
                                             "images_per_s": 79503.1, "gpu_busy": 0.93, "projected_minutes": 1.3},
                                            {"name": "cbn", "amp": "off", "mode": "left out (budget)",
                                             "skipped": "budget"}]}}
    text = markdown(report)
    assert "| tests | pass | 60.0 | 130 |" in text and "| bench-run | FAIL | 300.0 | 60 |" in text
    assert "ResNet-20 bn, CIFAR-10-sized, 120 epochs (bf16, channels_last, compile): 1.9 minutes" in text
    assert "| run | eager | 2.0 | 1.1 |" in text
    assert "| bn | bf16 | replayed vs plain | 24 | 0 |" in text and "| bn | bf16 | graph | 1.61 | 79503 | 93% | 1.30 |" in text
    assert "left out (budget): cbn off" in text


def test_gpu_check_fits_its_budget() -> None:
    """The default sections fit 10 minutes with make's offline install (20 s), each written."""
    from bnexp.bench.gpu_check import SECTIONS, TOTAL_BUDGET_S

    default = [s for s in SECTIONS if s.default]
    assert sum(s.budget_s for s in default) <= TOTAL_BUDGET_S == 580
    assert all(s.command for s in default)


def test_gpu_check_runs_the_named_checks_only() -> None:
    """``make gpu-check CHECKS="tests bench-step"``: a lease too short for every check runs some."""
    from bnexp.bench.gpu_check import checks, chosen

    assert [s.name for s in chosen(checks(True), ["bench-step", "tests"])] == ["tests", "bench-step"]
    assert [s.name for s in chosen(checks(True), [])] == ["tests", "step-graph", "table-cost", "imagenet-input"]
    with pytest.raises(SystemExit, match="unknown check 'bench-nope'; checks: tests, step-graph, table-cost, imagenet-input"):
        chosen(checks(True), ["bench-nope"])


def test_gpu_check_stops_a_section_at_its_budget_and_keeps_what_it_wrote(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from bnexp.bench import gpu_check

    monkeypatch.setattr(gpu_check, "OUT", tmp_path)
    slow = gpu_check.Section("slow", (sys.executable, "-c", "import time; print('measured', flush=True); "
                                                           "time.sleep(60)"), 1)
    outcome = gpu_check.run_check(slow)
    assert outcome["returncode"] is None and not outcome["ok"] and outcome["seconds"] < 30
    assert "measured" in outcome["tail"] and "stopped at its budget of 1 s" in outcome["tail"]


REPO = Path(__file__).resolve().parents[1]


def test_offline_requirements_expand_the_projects_own_extras() -> None:
    """``make wheels`` / ``install-offline`` ask pip for these names among wheels, where no
    ``bnexp[plot,...]`` exists (the first ``make gpu-check`` on an H100 stopped there)."""
    out = subprocess.run([sys.executable, "scripts/offline_requirements.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert not [line for line in out if line.lower().startswith(("bnexp", "torch"))]
    assert {"matplotlib>=3.7", "hydra-submitit-launcher>=1.2", "safetensors>=0.4", "pytest>=8.0"} <= set(out)
    assert len(out) == len(set(out))


def test_venv_made_by_a_venv_sees_its_packages(tmp_path: Path) -> None:
    """GPU images whose python3 is itself a venv holding PyTorch: ``venv --system-site-packages``
    made from it sees the base Python's packages only (the first ``make gpu-check`` on an H100
    found no torch); scripts/see_node_packages.py adds the maker's own site-packages."""
    node, made = tmp_path / "node", tmp_path / "made"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(node)], check=True)
    node_python = node / "bin" / "python"
    site = subprocess.run([str(node_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "node_only_package.py").write_text("HERE = True\n")
    subprocess.run([str(node_python), "-m", "venv", "--system-site-packages", "--without-pip", str(made)], check=True)
    probe = [str(made / "bin" / "python"), "-c", "import node_only_package"]
    assert subprocess.run(probe, capture_output=True).returncode != 0
    subprocess.run([str(node_python), str(REPO / "scripts" / "see_node_packages.py"), str(made)], check=True,
                   capture_output=True)
    assert subprocess.run(probe, capture_output=True).returncode == 0
