"""Running a Triton kernel's check under Triton's interpreter on the CPU: in a subprocess, since the
interpreter is chosen when a kernel is built (TRITON_INTERPRET=1 before Triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(code: str, seed: int, timeout: int = 300) -> None:
    """Run `code` (a Python script with {root} and {seed} to fill in, printing "ok" last) under the interpreter;
    AssertionError with the seed and the script's stderr unless it printed "ok"."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code.format(root=ROOT, seed=seed)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), f"seed {seed}:\n{done.stderr[-3000:]}"
