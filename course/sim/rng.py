"""The random generator's state read and set back inside a simulated capture, as torch's graph-safe
generators do (activation checkpointing recomputes the mask its forward drew).

While a capture runs, :func:`patches` make ``get_rng_state`` record a step that reads the generator
at each replay and ``set_rng_state`` one that puts that state back; outside a capture both are
torch's.
"""
from __future__ import annotations

import course.sim.stream as ss


def _save(state) -> None:
    import torch

    state.copy_(torch.default_generator.get_state())


def _restore(state) -> None:
    import torch

    torch.default_generator.set_state(state.clone())


def _record(cap, step, state) -> None:
    cap.note_work(ss.current_stream())
    cap.program.steps.append(("op", step, (state,), {}, []))


def patches(torch) -> list:
    """``(owner, name, replacement)`` for ``get_rng_state`` / ``set_rng_state`` (applied by
    :mod:`course.sim.patch`)."""
    get, put = torch.random.get_rng_state, torch.random.set_rng_state

    def get_rng_state():
        cap = ss.capturing()
        if cap is None:
            return get()
        state = get()  # the right size and type; every replay refreshes it before anything reads it
        _record(cap, _save, state)
        return state

    def set_rng_state(new_state) -> None:
        cap = ss.capturing()
        if cap is None:
            return put(new_state)
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            return put(new_state)  # torch's own error for a bad state
        _record(cap, _restore, new_state.clone() if new_state.is_inference() else new_state)
        return None

    get_rng_state.__doc__, set_rng_state.__doc__ = get.__doc__, put.__doc__
    return [(owner, name, repl) for owner in (torch, torch.random)
            for name, repl in (("get_rng_state", get_rng_state), ("set_rng_state", set_rng_state))]
