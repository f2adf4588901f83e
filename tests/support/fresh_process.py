"""Run a tests.support module in a fresh Python process whose Inductor cache holds no compiled
graph (its FX-graph and AOTAutograd entries removed; C++ kernels built earlier stay, which
only saves build time), as a restarted process on another machine would start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(
    module: str, args: list[str], inductor: Path, triton: Path | None = None
) -> tuple[str, str]:
    """(stdout, stderr) of `python -m module *args` on the Inductor cache `inductor` and the
    Triton cache `triton`; asserts a zero exit code (the stderr tail in the message)."""
    for entries in ("fxgraph", "aotautograd"):
        shutil.rmtree(inductor / entries, ignore_errors=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    if triton is not None:
        env["TRITON_CACHE_DIR"] = str(triton)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr
