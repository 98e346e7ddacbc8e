"""The learner's workspace: ``python -m course workspace`` (``make workspace``; ``make lab`` opens
it).

``work/`` (git-ignored) holds the learner's copies of the lessons and labs; JupyterLab opens there,
so the shipped notebooks that ``make test`` tests stay clean. Running it again adds new notebooks
and never overwrites a copy (``--reset NAME`` does). ``--lab`` starts JupyterLab headless on
127.0.0.1 (the URL with its token is printed; ``--allow-root`` as root), with nbgrader's extensions
and JupyterLab's announcements switched off (:func:`lab_command`, :func:`learner_config_dir`,
:func:`lab_env`), and forwards SIGTERM and SIGINT to it (:func:`serve`). Each copy's first cell says
what to do with it (:func:`your_copy_note`); the files the notebooks link to are copied beside them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from course.tools.catalog import ROOT, entries
from course.tools.learner_versions import source_note
from course.tools.links import copy_linked

WORKDIR = "work"
KINDS = ("lesson", "lab")  # solutions are not copied: the workspace is for the learner's own answers
CONFIG = ".course-jupyter"  # the learner's JupyterLab config, inside the workspace (hidden in the file browser)
# nbgrader 0.9's extensions (more are found where installed, see teacher_extensions)
NBGRADER_SERVER = ("nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.validate_assignment",
                   "nbgrader.server_extensions.assignment_list", "nbgrader.server_extensions.course_list")
NBGRADER_LAB = ("@jupyter/nbgrader",)
# JupyterLab 4's news prompt and update check live in this plugin (it asks while the setting
# fetchNews is "none")
ANNOUNCEMENTS = "@jupyterlab/apputils-extension:announcements"


def workspace_dir(root: Path = ROOT) -> Path:
    """The workspace folder for the course at ``root``."""
    return Path(root) / WORKDIR


def shipped(root: Path = ROOT) -> list:
    """The shipped notebooks a workspace holds copies of (lessons and labs), relative to ``root``.
    """
    return [e.path for kind in KINDS for e in entries(kind) if (Path(root) / e.path).exists()]


def create(root: Path = ROOT, dest: Path | None = None, reset=(), quiet: bool = False) -> Path:
    """Copy the lessons and labs into the workspace; keep every existing copy.

    ``reset`` names copies (file names or paths) to replace with a fresh copy of the shipped
    notebook. Returns the workspace folder.
    """
    root = Path(root)
    dest = Path(dest) if dest is not None else workspace_dir(root)
    wanted = set(reset)
    known = {Path(p).name for p in shipped(root)} | set(shipped(root))
    unknown = sorted(n for n in wanted if n not in known and Path(n).name not in known)
    if unknown:
        raise ValueError(f"--reset {unknown}: not a lesson or lab of the course; choose from "
                         f"{sorted(Path(p).name for p in shipped(root))}")
    say = (lambda *a: None) if quiet else print
    for rel in shipped(root):
        src, copy = root / rel, dest / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        fresh = rel in wanted or Path(rel).name in wanted
        if copy.exists() and not fresh:
            say(f"  kept   {copy}")
            continue
        shutil.copyfile(src, copy)
        make_yours(copy, rel)
        say(f"  {'reset ' if fresh else 'copied'} {copy}")
    for rel in copy_linked(root, shipped(root), dest):
        say(f"  linked {dest / rel}")
    return dest


def your_copy_note(rel: str) -> str:
    """The line that ends the first cell of the learner's copy of ``rel``: it is theirs, and how to
    check it."""
    name = Path(rel).name
    return (f"*This is your copy of the course's `{rel}`: edit it, run it, and check your "
            f"answers with `python -m course check {Path(WORKDIR) / rel}`. It is never "
            f"overwritten; `python -m course workspace --reset {name}` gives you a fresh one.*")


def make_yours(copy: Path, rel: str) -> None:
    """Rewrite the first cell of the copy at ``copy`` (of the shipped ``rel``) for the learner: the
    contributors' note ("a change goes into solutions/..., then regenerate") becomes
    :func:`your_copy_note`."""
    nb = nbformat.read(copy, as_version=4)
    note, mine = source_note(f"solutions/{Path(rel).name}"), your_copy_note(rel)
    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "markdown" and note in first.source:
        first.source = first.source.replace(note, mine)
    elif first is not None and first.cell_type == "markdown":
        first.source = first.source.rstrip("\n") + "\n\n" + mine
    else:
        cell = nbformat.v4.new_markdown_cell(mine)
        cell["id"] = "your-copy"
        nb.cells.insert(0, cell)
    nbformat.write(nb, copy)


def is_root() -> bool:
    """True when running as root (JupyterLab then needs ``--allow-root``)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def teacher_extensions() -> tuple:
    """(server extensions, JupyterLab extensions) of nbgrader: the known ones and any installed one
    named nbgrader."""
    from jupyter_core.paths import jupyter_config_path, jupyter_path

    server, lab = set(NBGRADER_SERVER), set(NBGRADER_LAB)
    for folder in map(Path, jupyter_config_path()):
        for f in [folder / "jupyter_server_config.json", *sorted((folder / "jupyter_server_config.d").glob("*.json"))]:
            try:
                names = json.loads(f.read_text(encoding="utf-8"))["ServerApp"]["jpserver_extensions"]
                server |= {n for n in names if "nbgrader" in n}
            except (OSError, ValueError, KeyError, TypeError):  # absent or not ours to read: skip
                continue
    for folder in map(Path, jupyter_path("labextensions")):
        for pkg in [*folder.glob("*/package.json"), *folder.glob("@*/*/package.json")]:
            try:
                name = json.loads(pkg.read_text(encoding="utf-8"))["name"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if "nbgrader" in name:
                lab.add(name)
    return sorted(server), sorted(lab)


def learner_config_dir(dest: Path) -> Path:
    """Write the learner's JupyterLab config into ``dest/.course-jupyter`` (nbgrader's extensions,
    JupyterLab's announcements and the server's news feed off); return it."""
    server, lab = teacher_extensions()
    cfg = Path(dest) / CONFIG
    (cfg / "labconfig").mkdir(parents=True, exist_ok=True)
    (cfg / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {n: True for n in [*lab, ANNOUNCEMENTS]}}, indent=1) + "\n",
        encoding="utf-8")
    (cfg / "jupyter_server_config.json").write_text(
        json.dumps({"ServerApp": {"jpserver_extensions": {n: False for n in server}},
                    "LabApp": {"news_url": None}}, indent=1) + "\n",
        encoding="utf-8")
    return cfg


def lab_env(dest: Path, base: dict | None = None) -> dict:
    """The environment for the learner's JupyterLab: ``base`` (default: this one) with
    :func:`learner_config_dir` first on ``JUPYTER_CONFIG_PATH`` (the highest-priority config
    folder)."""
    env = dict(os.environ if base is None else base)
    rest = [p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p]
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(learner_config_dir(dest))] + rest)
    return env


def lab_command(dest: Path, port: int = 8888, ip: str = "127.0.0.1", token: str | None = None) -> list:
    """The JupyterLab command line serving the workspace ``dest`` headless, nbgrader's server
    extensions off.

    Run it with :func:`lab_env`'s environment, which also turns off nbgrader's JupyterLab extension.
    """
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={dest}", "--no-browser",
           f"--ip={ip}", f"--port={port}"]
    cmd += [f"--ServerApp.jpserver_extensions={n}=False" for n in teacher_extensions()[0]]
    if token is not None:
        cmd.append(f"--IdentityProvider.token={token}")
    if is_root():
        cmd.append("--allow-root")
    return cmd


def serve(cmd: list, env: dict | None = None, timeout: float = 30.0) -> int:
    """Run ``cmd`` (JupyterLab) until it exits; a SIGTERM or SIGINT sent here is passed on as
    SIGTERM and waited for (``timeout`` s, then a kill), so nothing is left running. Its exit code
    (0 when signalled)."""
    child = subprocess.Popen(cmd, env=env)
    stopped = []

    def forward(signum, frame):  # noqa: ARG001 - signal handler signature
        if not stopped and child.poll() is None:
            child.terminate()
        stopped.append(time.monotonic())

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while child.poll() is None:
            # asked to stop, still running: kill
            if stopped and time.monotonic() - stopped[0] > timeout:
                child.kill()
            try:
                child.wait(timeout=0.2)  # short waits: a handler runs between them
            except subprocess.TimeoutExpired:
                continue
            except KeyboardInterrupt:  # a Ctrl-C that reached Python before the handler was set
                forward(signal.SIGINT, None)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if child.poll() is None:
            child.kill()
        child.wait()
    return 0 if stopped else child.returncode


def main(lab: bool = False, reset=(), port: int = 8888, ip: str = "127.0.0.1", dest=None) -> int:
    """Create or update the workspace (``dest``, default ``work/``); with ``lab``, start JupyterLab
    there (until Ctrl-C or SIGTERM, both passed on to it)."""
    try:
        dest = create(dest=dest, reset=reset)
    except ValueError as e:
        print(f"course workspace: {e}")
        return 2
    print(f"\nYour workspace is {dest}/ (git-ignored: your "
          "answers and outputs stay out of the shipped course).")
    print(f"Start with {dest / 'notebooks' / '00_start_here.ipynb'}; check a lab with "
          f"python -m course check {Path(dest) / 'labs' / 'lab1_embedding_kernel.ipynb'}")
    if not lab:
        print("Open it in JupyterLab: make lab (or python -m course workspace --lab)")
        return 0
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        print("course workspace: JupyterLab is not installed here: pip install 'jupyterlab>=4' "
              "(make lab installs it), then run again.")
        return 2
    print(f"\nStarting JupyterLab on {dest}/ (headless: open the "
          f"http://127.0.0.1:{port}/lab?token=... URL it prints, "
          "then notebooks/00_start_here.ipynb in its file browser).")
    print(f"On a remote machine: ssh -L {port}:localhost:{port} "
          "USER@HOST, then open that URL on your computer.\n",
          flush=True)
    return serve(lab_command(dest, port=port, ip=ip), env=lab_env(dest))
