"""A normalization and a model added from outside bnexp, each as its module and its config
file, train, pack and bench without any other file changing (docs/architecture.md).

The toy package lives in a temporary folder: ``toy_methods/__init__.py`` defines and
registers a norm (per-channel mean removal over the batch) and a model (one hidden
normalized Linear), ``toy_methods/configs/norm/toy_center.yaml`` and
``toy_methods/configs/model/toy_mlp.yaml`` are their presets. ``BNEXP_PLUGINS=toy_methods``
is all bnexp is told. The commands run in fresh processes, as a user runs them, so the
registries of this test process stay as bnexp ships them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]

NORM_MODULE = '''
import torch
from torch import nn

from bnexp.models.registry import register_model
from bnexp.nn.create_norm import register_norm


class CenterNorm(nn.Module):
    """x minus its mean over the batch (and positions), per channel; no parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        return x - x.mean(dim=dims, keepdim=True)


def center_norm(num_features: int) -> nn.Module:
    return CenterNorm()


register_norm("toy_center", center_norm, center_norm, keys=())


@register_model("toy_mlp")
def toy_mlp(b, data, cfg):
    width = cfg.get("width", 8)
    return nn.Sequential(nn.Flatten(), b.linear(data.in_channels * data.image_size ** 2, width, normalize=True,
                                                image_input=True),
                         b.act(), b.classifier(width, data.num_classes))
'''
NORM_CONFIG = "name: toy_center\nlayer: toy_center\nplacement: after_op\nop_bias: null\nbnp: null\n"
MODEL_CONFIG = "name: toy_mlp\nwidth: 8\ninit_scale: 1.0\n"
TINY = ["data=synthetic", "data.image_size=4", "data.train_size=32", "data.test_size=16", "trainer.batch_size=8",
        "trainer.max_steps=3", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The toy package's two files and two presets; the environment that names it."""
    root = tmp_path_factory.mktemp("plugin")
    package = root / "toy_methods"
    (package / "configs" / "norm").mkdir(parents=True)
    (package / "configs" / "model").mkdir(parents=True)
    (package / "__init__.py").write_text(NORM_MODULE)
    (package / "configs" / "norm" / "toy_center.yaml").write_text(NORM_CONFIG)
    (package / "configs" / "model" / "toy_mlp.yaml").write_text(MODEL_CONFIG)
    return {**os.environ, "BNEXP_PLUGINS": "toy_methods", "PYTHONPATH": f"{root}{os.pathsep}{ROOT}"}


def bnexp(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bnexp", *args], env=env, cwd=cwd, capture_output=True, text=True)


def test_toy_norm_and_model_train_and_pack(plugin: dict[str, str], tmp_path: Path) -> None:
    alone = bnexp(["train", "model=toy_mlp", "norm=toy_center", *TINY], plugin, tmp_path)
    assert alone.returncode == 0, alone.stderr
    [run] = [p.parent for p in (tmp_path / "results").rglob("summary.json")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["config"]["norm"]["layer"] == "toy_center"
    assert summary["params"] == 3 * 16 * 8 + (8 + 1) * 10  # op_bias null: the normalized Linear has no bias
    packed = bnexp(["train", "model=toy_mlp", "norm=toy_center", "trainer.pack=2", "trainer.seed=5", *TINY],
                   plugin, tmp_path)
    assert packed.returncode == 0, packed.stderr
    seeds = {json.loads(p.read_text())["config"]["trainer"]["seed"]: json.loads(p.read_text())["status"]
             for p in (tmp_path / "results").rglob("summary.json")}
    assert seeds == {0: "completed", 5: "completed", 6: "completed"}


def test_toy_norm_and_model_bench(plugin: dict[str, str], tmp_path: Path) -> None:
    norms = bnexp(["bench", "norms", "norms=toy_center", "nets=resnet20", "batch=2", "reps=1", "number=1",
                   "warmup=0", "modes=eager", "device=cpu", f"out={tmp_path / 'norms.json'}"], plugin, tmp_path)
    assert norms.returncode == 0, norms.stderr
    records = json.loads((tmp_path / "norms.json").read_text())
    assert {(r["name"], r["baseline"]) for r in records} == {("toy_center", "bn/eager")}
    step = bnexp(["bench", "step", "models=toy_mlp", "norms=toy_center", "batch=4", "image_size=4", "reps=1",
                  "number=1", "warmup=0", "modes=eager", "device=cpu", f"out={tmp_path / 'step.json'}"],
                 plugin, tmp_path)
    assert step.returncode == 0, step.stderr
    records = json.loads((tmp_path / "step.json").read_text())
    assert {(r["model"], r["name"], r["baseline"]) for r in records} >= {("toy_mlp", "toy_center", "bn/eager")}


def test_toy_norm_is_its_formula_in_float64(plugin: dict[str, str], tmp_path: Path) -> None:
    """create_norm builds the plugin's layer by name; its output is x minus the batch mean per
    channel, evaluated independently below."""
    code = ("import torch, sys; from bnexp.nn.create_norm import create_norm; "
            "x = torch.load(sys.argv[1]); torch.save(create_norm('toy_center', 3, 2)(x), sys.argv[2])")
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.pt"), str(tmp_path / "y.pt")], env=plugin,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    y = torch.load(tmp_path / "y.pt", weights_only=True)
    expected = x.clone()
    for c in range(3):
        expected[:, c] -= x[:, c].sum() / x[:, c].numel()
    assert torch.allclose(y, expected, rtol=0, atol=1e-15)


def test_an_unimportable_plugin_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "BNEXP_PLUGINS": "no_such_plugin_module", "PYTHONPATH": str(ROOT)}
    done = bnexp(["train", "model=mlp3x100", *TINY], env, tmp_path)
    assert done.returncode == 2 and "BNEXP_PLUGINS=no_such_plugin_module: cannot import 'no_such_plugin_module'" \
        in done.stderr and "Traceback" not in done.stderr


# Plugins that fail as they are imported: each was a traceback (or, for a name another module
# took, a ValueError from the registry). (module text, the line it fails at, what the one line then says)
BROKEN_PLUGINS = {
    "syntax": ("def f(:\n", 1, "SyntaxError: invalid syntax"),
    "raises": ("raise RuntimeError('no GPU driver')\n", 1, "RuntimeError: no GPU driver"),
    "path_name": ("from torch import nn\nfrom bnexp.nn.create_norm import register_norm\n"
                  "register_norm('../evil', nn.BatchNorm1d, nn.BatchNorm2d, ('eps',))\n", 3,
                  "ConfigError: norm layer name '../evil' is not valid: use letters, digits and _"),
    "norm_taken": ("from torch import nn\nfrom bnexp.nn.create_norm import register_norm\n"
                   "register_norm('batchnorm', nn.BatchNorm1d, nn.BatchNorm2d, ('eps',))\n", 3,
                   "ConfigError: norm layer 'batchnorm' is registered already (by bnexp or another plugin)"),
    "model_taken": ("from bnexp.models.registry import register_model\n\n@register_model('resnet20')\n"
                    "def build(b, data, cfg):\n    return None\n", 3,
                    "ConfigError: model 'resnet20' is registered already (by bnexp or another plugin)"),
}


@pytest.mark.parametrize("case", BROKEN_PLUGINS)
def test_a_plugin_that_fails_as_it_is_imported_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str], case: str) -> None:
    """Run in this process: the import fails before anything registers, so the registries stay
    as bnexp ships them."""
    text, line, says = BROKEN_PLUGINS[case]
    module = f"broken_{case}"
    (tmp_path / f"{module}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("BNEXP_PLUGINS", module)
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(["train", "model=mlp3x100", *TINY], capsys)
    assert code == 2 and out.count("\n") == 1, out
    assert out.startswith(f"bnexp: error: BNEXP_PLUGINS={module}: the plugin '{module}' failed as it was imported "
                          f"({tmp_path / module}.py, line {line}): {says}"), out
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{module}.py"]
