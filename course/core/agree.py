"""Ranks that agree before they act: one small exchange over a gloo group with a short time limit.

A check that runs on every rank (lesson 05's input guard, exercise 08.1's trace) lets each rank say
what it found before any collective that could wait forever; every rank then gets the same verdict,
naming the rank at fault. :func:`exchange` is that one all-gather, over a gloo group of the same
ranks made with its own time limit (:func:`group_for`: a rank that never comes stops the others in
seconds, not after the run's limit), on the NCCL path as on gloo CPU processes.

When one rank stops, the others see only that their peer went: gloo's "Connection closed by peer"
or a time-out. :func:`knock_on` recognises those messages, so the launcher
(:mod:`course.core.launch`) names the rank whose own error caused them, and :class:`RankLost` says
the waiting rank is not at fault.
"""
from __future__ import annotations

import datetime

# a rank's error that only says another rank went (or never came): the consequence, not the cause
KNOCK_ON = ("connection closed by peer", "connection reset by peer", "broken pipe",
            "timed out waiting", "timed out", "timeout", "communicator was aborted",
            "remote process exited", "socket closed", "did not reach", "has not answered")

_groups: dict = {}


class RankLost(RuntimeError):
    """Another rank did not reach the exchange in time: it stopped earlier (its own error names
    why) or waits in another call."""


def knock_on(message: str) -> bool:
    """True when ``message`` (a rank's error) only says that another rank went or never came."""
    low = (message or "").lower()
    return any(k in low for k in KNOCK_ON)


def group_for(group=None, timeout_s: float = 30.0):
    """A gloo group of ``group``'s ranks (default: all) with a ``timeout_s`` limit per call, made
    once per process. Only its members call it, asking for their groups in the same order."""
    import torch.distributed as dist  # on use: a rank dies with its parent before importing torch

    ranks = tuple(dist.get_process_group_ranks(group) if group is not None
                  else range(dist.get_world_size()))
    world = dist.distributed_c10d._get_default_group()
    key = (id(world), ranks, float(timeout_s))
    if key not in _groups or _groups[key][0] is not world:  # a new default group: new groups
        made = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                              timeout=datetime.timedelta(seconds=timeout_s))
        _groups[key] = (world, made)
    return _groups[key][1]


def exchange(obj, group=None, timeout_s: float = 30.0, what: str = "the check") -> list:
    """Every rank's ``obj`` (picklable), in rank order, over :func:`group_for`'s group; a rank
    that does not come within ``timeout_s`` makes it raise :class:`RankLost` on those that did."""
    import torch.distributed as dist

    g = group_for(group, timeout_s)
    out = [None] * dist.get_world_size(g)
    try:
        dist.all_gather_object(out, obj, group=g)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError or DistBackendError
        if not knock_on(str(e)):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RankLost(f"rank {dist.get_rank()}: another rank did not reach {what} within "
                       f"{timeout_s:.0f} s ({first[:160]}): it stopped earlier (its own error "
                       "names the cause) or waits in another call") from None
    return out
