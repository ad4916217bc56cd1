"""Profile training steps of ResNet-20 on the GPU with torch.profiler (docs/benchmarks.md).

``python scripts/profile_step.py [OVERRIDE ...]`` times ``bnexp bench step``'s step (compiled,
bf16, channels_last, batch 128 by default; Hydra overrides change the config) for 5 steps
after 15 warm-up steps, and prints the operators by host time and by device time.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bnexp.bench.common import compose_train
from bnexp.bench.step import step_case
from bnexp.models import DataSpec

WARMUP, STEPS, BATCH = 15, 5, 128
DEFAULTS = ["model=resnet20", "norm=bn", "trainer.compile=true", "trainer.amp=bf16", "trainer.channels_last=true",
            "trainer.device=cuda"]


def main(overrides: list[str]) -> None:
    cfg = compose_train([*DEFAULTS, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        step = step_case(cfg, DataSpec(10, 3, 32), BATCH, torch.device("cuda"), Path(tmp))
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    launches = sum(e.count for e in table if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(f"per step: host {sum(e.self_cpu_time_total for e in table) / STEPS:.0f} us, "
          f"device {sum(e.self_device_time_total for e in table) / STEPS:.0f} us, {launches / STEPS:.0f} launches")


if __name__ == "__main__":
    main(sys.argv[1:])
