"""Run one function in a fresh Python process, for work that could leave the process in a bad state.

Used for experiments that start ``torch.profiler`` (CUPTI state) and for captures that are meant to
fail in ways CUDA may not fully undo (a capture ended with unjoined streams): whatever they leave
behind stays in that process. :func:`env_set` sets the environment a child process inherits
(workers, notebook kernels) for a block, and puts the parent's back after it.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys


def run_isolated(module: str, func: str, *, timeout: float = 600, **kwargs):
    """``module.func(**kwargs)`` in a fresh Python process (JSON in, JSON out); a clear error if it
    fails or hangs."""
    code = (f"import json, sys\nimport {module} as M\n"
            f"res = M.{func}(**json.loads(sys.argv[1]))\nprint('ISOLATED ' + json.dumps(res))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{module}.{func} did not finish within "
                           f"{timeout:.0f} s in its own process") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("ISOLATED "):
            return json.loads(line[len("ISOLATED "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"{module}.{func} failed in its own process "
                       f"(exit {proc.returncode}): {' / '.join(tail)}")


@contextlib.contextmanager
def env_set(values: dict):
    """Inside the block, ``os.environ`` holds ``values`` (a name -> a string; None: the name unset);
    after it, each name is back as it was (set to its old value, or unset). What a child process
    started inside inherits."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
