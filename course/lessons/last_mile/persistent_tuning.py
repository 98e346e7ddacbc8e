"""The persistent step's launch shapes: the candidates a search on the GPU tries, and the one its
recording chose.

One program per SM walks every stage's tiles in turn, so what keeps memory busy is what one
program has in flight: its tile's rows x the columns per chunk x the chunks in flight.
:data:`CANDIDATES` are what ``last_mile_persistent_search`` (:mod:`.bench`) times on a GPU;
:func:`tuned` gives the decoder the chosen one on the GPU the recording was made on, only where it
beat the defaults beyond the spread and was correct (:func:`choose`); elsewhere the defaults stand.
"""
from __future__ import annotations

import dataclasses

from course.core.reference import load_reference
from course.lessons.last_mile.decoder import Launch, _p2, sizes

NAME = "last_mile_persistent_search"
DEFAULT = "defaults"
# candidate -> (warps, programs per SM, {stage: (rows, widest chunk, chunks in flight)}); a chunk is
# never wider than its stage's input. Bytes in flight per program ~ rows x chunk x depth x 2.
CANDIDATES = {
    DEFAULT: (8, 1, {}),
    "q/k/v 4 rows, whole rows": (8, 1, {"qkv": (4, 2048, 1)}),
    "chunks of 1024": (8, 1, {"qkv": (4, 2048, 1), "o": (16, 1024, 2), "gate_up": (8, 1024, 2),
                              "down": (16, 1024, 2), "lm_head": (16, 1024, 2)}),
    "chunks of 1024, 16 warps": (16, 1, {"qkv": (4, 2048, 1), "o": (16, 1024, 2),
                                         "gate_up": (8, 1024, 2), "down": (16, 1024, 2),
                                         "lm_head": (16, 1024, 2)}),
    "32 rows, 16 warps": (16, 1, {"qkv": (8, 2048, 1), "o": (32, 512, 2), "gate_up": (16, 512, 2),
                                  "down": (32, 512, 2), "lm_head": (32, 512, 2)}),
    "2 programs per SM, 4 warps": (4, 2, {}),
    "2 per SM, 4 warps, q/k/v 4 rows": (4, 2, {"qkv": (4, 2048, 1)}),
}


def shapes_for(config, stages: dict, model_config):
    """``config`` (a :class:`~.decoder.Config`) with ``stages``' (rows, widest chunk, depth) for a
    model of ``model_config``: no chunk wider than its stage's input (the next power of two)."""
    h, i, _, nh, _, d = sizes(model_config)
    width = {"qkv": _p2(h), "o": _p2(nh * d), "gate_up": _p2(h), "down": _p2(i), "lm_head": _p2(h)}
    over = {s: Launch(rows, min(widest, width[s]), getattr(config, s).warps, depth)
            for s, (rows, widest, depth) in stages.items()}
    return dataclasses.replace(config, **over)


def choose(result) -> str | None:
    """The candidate of a search ``result`` to adopt: the fastest correct one whose third quartile
    lies below the defaults' first (beyond the spread); None where none does."""
    by = {r["candidate"]: r for r in result.rows}
    base = by.get(DEFAULT)
    if not base or base["status"] != "ok" or base["q1_us"] != base["q1_us"]:
        return None
    ok = [r for n, r in by.items() if n in CANDIDATES and n != DEFAULT and r["status"] == "ok"
          and r["correct"] and r["q3_us"] == r["q3_us"] and r["q3_us"] < base["q1_us"]]
    return min(ok, key=lambda r: r["us"])["candidate"] if ok else None


def chosen(device_name: str) -> str:
    """The candidate the decoder takes on a GPU called ``device_name``: the recorded search's
    choice where it was made on that GPU and chose one (:func:`choose`), else :data:`DEFAULT`."""
    try:
        res = load_reference(NAME)
    except FileNotFoundError:
        return DEFAULT
    if res.provenance.get("device") != device_name or res.params.get("quick"):
        return DEFAULT
    return choose(res) or DEFAULT


def tuned(device_name: str):
    """``(warps, programs per SM, stages)`` of :func:`chosen`'s candidate on ``device_name``, or
    None where that is the defaults."""
    name = chosen(device_name)
    return None if name == DEFAULT else CANDIDATES[name]
