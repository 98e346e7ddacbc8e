"""Run one function in a fresh Python process, for work that could leave the process in a bad state.

Used for experiments that start ``torch.profiler`` (CUPTI state) and for captures that are meant to fail in ways
CUDA may not fully undo (a capture ended with unjoined streams): whatever they leave behind stays in that process.
"""
from __future__ import annotations

import json
import subprocess
import sys


def run_isolated(module: str, func: str, *, timeout: float = 600, **kwargs):
    """``module.func(**kwargs)`` in a fresh Python process (JSON in, JSON out); a clear error if it fails or hangs."""
    code = (f"import json, sys\nimport {module} as M\n"
            f"res = M.{func}(**json.loads(sys.argv[1]))\nprint('ISOLATED ' + json.dumps(res))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{module}.{func} did not finish within {timeout:.0f} s in its own process") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ISOLATED "):
            return json.loads(line[len("ISOLATED "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"{module}.{func} failed in its own process (exit {proc.returncode}): {' / '.join(tail)}")
