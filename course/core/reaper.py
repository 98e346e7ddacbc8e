"""A stopped run takes its processes with it.

Two ends of one rule. A worker process the course starts (:mod:`course.core.launch`'s ranks) asks
the kernel to kill it when its parent dies (:func:`die_with_parent`, Linux's parent-death signal),
so a notebook kernel or a ``python`` killed without a word (SIGKILL, a lost terminal) leaves no rank
behind, holding a GPU or a port. And ``python -m course check``, stopped by ``timeout`` (SIGTERM), a
hang-up or Ctrl-C, kills the process group of the notebook kernel it started (the kernel and every
rank it launched) before it exits (:func:`killed_on_signal`).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; exit at once if the parent is already
    gone.

    ``parent_pid``: the parent's pid as the parent saw it (a parent that died before this call is
    noticed). Returns True where the request took (Linux), False elsewhere (the launcher's own time
    limit still holds)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the request: nobody is left to report to
    return True


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to process group ``pgid`` (never this process's own); True if it was sent."""
    if not pgid or pgid <= 1 or pgid == os.getpgrp():
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kernel_groups(client) -> list:
    """The process group of a notebook client's kernel (the kernel and the rank processes it
    started), if running: ``[pgid]`` of jupyter_client's local provisioner (which starts each kernel
    in its own session), else ``[]``."""
    pgid = getattr(getattr(getattr(client, "km", None), "provisioner", None), "pgid", None)
    return [pgid] if pgid else []


@contextlib.contextmanager
def killed_on_signal(groups, what: str = "the run"):
    """While inside: SIGTERM, SIGHUP or SIGINT first kills the process groups ``groups()`` returns
    (pgids), then stops this process as that signal would (SystemExit with code 128+n, Ctrl-C
    included), with a line on stderr saying so. Outside the main thread it does nothing (signals
    reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}

    def handler(signum, frame):
        killed = [g for g in list(groups() or ()) if kill_group(g)]
        for s, h in saved.items():
            signal.signal(s, h)
        name = signal.Signals(signum).name
        done = (f"killed its process group(s) {killed} (the kernel and the ranks it started)"
                if killed else "no child process was running")
        print(f"\n{what}: stopped by {name}; {done}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)  # the shell's code for "stopped by that signal", quietly

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        saved[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in saved.items():
            if signal.getsignal(s) is handler:
                signal.signal(s, h)
