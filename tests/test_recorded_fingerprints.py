"""The fingerprints of the presets' runs, recorded before issue 25's corrections: a preset
cell that computes what it did then keeps its fingerprint, so its finished runs are still
found complete (``bnexp.engine.identity.NEUTRAL_SINCE_ADDED``, ``LOOKUP_KEYS``, and per-norm
settings given only to the norms that read them, ``configs/norm_defaults_layer/``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bnexp.engine.identity import cell_name, fingerprint, override_key, short_hash
from bnexp.report import presets
from bnexp.report.presets import load_preset, preset_names

RECORD = Path(__file__).parent / "data" / "fingerprints_before_issue25.json"
HOW = ("cell_fingerprints of every preset under commit c76dbb4 (before issue 25), made once by "
       "`git worktree add /tmp/old c76dbb4; PYTHONPATH=/tmp/old python tests/test_recorded_fingerprints.py "
       "> tests/data/fingerprints_before_issue25.json` (this file's functions, the old bnexp and configs)")
# The cells whose computation issue 25 changed on purpose, and the cells it added or removed.
CHANGED = {
    "bnp/fc": {  # TensorFlow's BN / batch renorm / LN defaults, post-activation with biases (BNP eq. 2)
        f"norm={norm},paper_data={data},trainer.batch_size={batch}"
        for norm, data, batch in [("bn", "mnist", 60), ("bn", "cifar10", 60), ("bn", "cifar10", 6),
                                  ("brn", "cifar10", 6), ("ln", "mnist", 60), ("ln", "cifar10", 60),
                                  ("ln", "cifar10", 6), ("ln", "cifar10", 1)]},
    "bnp/cnn5": {
        "norm=bn,trainer.batch_size=128", "norm=bn,trainer.batch_size=2",  # TensorFlow's BN
        "norm=brn,trainer.batch_size=2",  # TensorFlow's batch renorm (no clipping)
        "norm=none,trainer.batch_size=128", "norm=none,optim=adam,trainer.batch_size=128",  # Adam for vanilla
        "norm=bn_4things,optim=adam,trainer.batch_size=128",  # BN with 4 things, new
        "norm.groups=4,norm=bn_4things,optim=adam,trainer.batch_size=2",
        "norm.groups=4,norm=bn_4things,optim=adam,trainer.batch_size=1"},
    # bnp/timing: its BN cells took TensorFlow's BN in issue 25 and PyTorch's again in issue 38
    # (an exploratory experiment, run in PyTorch), so they are back to their recorded fingerprints
    "bnp/resnet110": {"norm=bn", "norm=bnp_gn"},  # He et al.'s warmup; He-normal x 0.1
    "bnp/preact110": {"norm=bn", "norm=bnp_gn"},  # He et al.'s warmup; He-normal x 0.4
    "popnorm/ablation": {f"act={act},pop_part=mean_only" for act in ("relu", "sigmoid", "tanh")},  # kappa 1
}
# The cells issue 38 changed on purpose (2026-11-28), and the presets it added.
ACTS5, ACTS3 = ("relu", "selu", "sigmoid", "swish", "tanh"), ("relu", "sigmoid", "tanh")
ISSUE38 = {
    # pixels / 255 (the TensorFlow tutorial's input) instead of per-channel standardization: every cell
    "bnp/fc": {f"norm={norm},paper_data={data},trainer.batch_size={batch}"
               for data, batch, norms in [("mnist", 60, "none bn bnp ln"), ("cifar10", 60, "none bn bnp ln"),
                                          ("cifar10", 6, "none bn bnp brn ln"), ("cifar10", 1, "none bnp ln")]
               for norm in norms.split()},
    "bnp/cnn5": {"norm=bnp,trainer.batch_size=1", "norm=bnp,trainer.batch_size=128", "norm=bnp,trainer.batch_size=2",
                 "norm=none,trainer.batch_size=1", "norm=none,trainer.batch_size=2"},  # the cells issue 25 left
    # POP-Norm's CIFAR batches from a permutation per epoch, not drawn with replacement: every cell
    "popnorm/table1": {f"act={act},model={model},norm={norm},paper_data={data}" for act in ACTS3
                       for model in ("resnet20", "vgg16") for norm in ("bn", "popnorm") for data in ("cifar10", "cifar100")},
    "popnorm/kappa": {f"act={act},norm.rho={kappa}" for act in ACTS3 for kappa in ("1.0", "4.0", "16.0")},
    "popnorm/ablation": {f"act={act},pop_part={part}" for act in ACTS3
                         for part in ("bn", "division_only", "none", "popnorm", "mean_only")},
    # CBN Fig. 10: the grad_var probe on (probes=[grad_var]), and vanilla BN added
    "cbn/amat": {f"act={act},amat_mode={mode}" for act in ACTS5 for mode in ("adaptive", "bn", "fixed", "off")},
    # presets added: CBN Fig. 7, CBN Figs. 2-3, BNP Fig. 7
    "cbn/grad_norm": {f"act={act},cbn_part={part}" for act in ACTS5
                      for part in ("cbn", "l2_division", "mean_removal", "none")},
    "cbn/eta_tau": {f"act={act}" for act in ACTS5},
    "bnp/fig7": {"norm=bn", "norm=bnp_gn", "norm=gn"},
}
CHANGED = {name: CHANGED.get(name, set()) | ISSUE38.get(name, set()) for name in CHANGED.keys() | ISSUE38.keys()}


def cell_fingerprints(name: str) -> dict[str, str]:
    """Each sweep cell of preset ``name`` (its runs but the seed) and a hash of its runs'
    fingerprints, in seed order."""
    p = load_preset(name)
    runs: dict[str, list[tuple[str, str]]] = {}
    for job, cfg in zip(p.jobs, presets.job_configs(name, "full", p.jobs)):
        seed = ",".join(o for o in job if override_key(o) == "trainer.seed")
        cell = cell_name([o for o in job if override_key(o) != "trainer.seed"])
        runs.setdefault(cell, []).append((seed, fingerprint(cfg)))
    return {cell: short_hash(",".join(fp for _, fp in sorted(seen))) for cell, seen in sorted(runs.items())}


def test_every_recorded_preset_still_exists() -> None:
    assert set(json.loads(RECORD.read_text())["presets"]) <= set(preset_names())


# One test per preset (some take a minute alone): parallel workers share them out.
@pytest.mark.slow
@pytest.mark.parametrize("name", preset_names())
def test_unchanged_cells_keep_their_fingerprints(name: str) -> None:
    """Every cell of the preset has the fingerprints it had before issue 25, except the
    cells listed in CHANGED, and each of those differs (or is new, or gone)."""
    now, then = cell_fingerprints(name), json.loads(RECORD.read_text())["presets"].get(name, {})
    differ = {cell for cell in set(now) | set(then) if now.get(cell) != then.get(cell)}
    assert differ == CHANGED.get(name, set()), name


if __name__ == "__main__":  # the recording (HOW)
    json.dump({"how": HOW, "presets": {name: cell_fingerprints(name) for name in preset_names()}},
              sys.stdout, indent=0, sort_keys=True)
