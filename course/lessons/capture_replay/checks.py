"""Lesson 02's exercises 02.1-02.5: on the recordings (the kernel sweep, the new shapes) and on
section 1's graph (replay with new data, serve requests). 02.6-02.8 are in :mod:`.capture_checks`.
"""
from __future__ import annotations

import numpy as np
import torch

import course
from course.core import reference
from course.core.checks import exercise
from course.core.harness import check, expect


def small_mlp(d_in: int = 16, hidden: int = 32, d_out: int = 4, seed: int = 0):
    """A small MLP on the course's device, the same weights for the same seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, d_out)).to(course.device())


def check_per_kernel_saving(fn, sweep) -> None:
    """02.1: ``fn(sweep)`` is the sweep's own fit of the saving per kernel."""
    with exercise("02.1 saving per kernel", hint=[
                "a slope is a time per kernel: fit each column (eager, replayed) against "
                "'kernels', and compare the slopes",
                "in your function: fit eager_us and replay_us separately, on the rows with kernels "
                ">= 16, then subtract",
                "a smaller example: np.polyfit([16, 32, 64], [40, 72, 136], 1)[0] is 2.0: 2 us "
                "more for every extra kernel"],
            answer="return slope(eager_us) - slope(replay_us), with slope = np.polyfit(kernels, y, "
                   "1)[0] on the rows with kernels >= 16"):
        t = {"got": fn(sweep), "want": sweep.value("saving per kernel (fit)")}
        close = lambda t: abs(t["got"] - t["want"]) <= 0.02 * abs(t["want"]) + 1e-6  # noqa: E731
        check(t, [expect("fit", close, lambda t: f"got {t['got']:.3f} us per kernel, expected "
                                                 f"{t['want']:.3f}")])


def check_break_even(fn, new_shape) -> None:
    """02.2: ``fn(row)``, the replays after which a new shape paid for itself, on every row with a
    saving."""
    with exercise("02.2 break-even replays", hint=[
                "a new shape costs a warm-up and a capture once; each replay then saves the "
                "difference between an eager call and a replayed one: break-even is the one-off "
                "cost over that saving",
                "in your function: the row holds warmup_ms, capture_ms, eager_us and replay_us; "
                "mind the units: the one-off cost is in ms, the times per call in us",
                "a smaller example: 2 ms of warm-up and capture, 50 us eager, 10 us replayed: 2000 "
                "us / 40 us = 50 replays"],
            answer="(row['warmup_ms'] + row['capture_ms']) * 1000 / (row['eager_us'] - "
                   "row['replay_us'])"):
        for r in (r for r in new_shape.rows if r["break_even_replays"] is not None):
            want = r["break_even_replays"]
            check(fn(r), [expect("break_even", lambda got: abs(got - want) <= 1e-6 * want + 1e-9,
                                 lambda got: f"batch {r['batch']}: got {got:.1f} replays, expected "
                                             f"{want:.1f}")])


def check_replay_with(fn, model) -> None:
    """02.3: ``fn(new_x)``, ``model(new_x)`` computed by section 1's graph, safe from the next
    replay."""
    with exercise("02.3 replay with new data", hint=[
                "the graph reads static_x and writes static_y, always: the same memory at every "
                "replay",
                "in your function: put the new data where the graph reads it (in place), replay, "
                "and keep the result from being overwritten by the next replay",
                "a smaller example: b = torch.zeros(3); a = b; a.copy_(torch.ones(3)) changes b, a "
                "= torch.ones(3) does not; r = b; b.add_(1) changes r too, r = b.clone() keeps it"],
            answer="static_x.copy_(new_x); g.replay(); return static_y.clone()"):
        a, b = (torch.randn(16, 64, device=course.device()) for _ in range(2))
        t = {"a": fn(a), "b": fn(b)}
        with torch.no_grad():
            check(t, [expect("kept", lambda t: torch.allclose(t["a"], model(a), atol=1e-5),
                             "the first result is not model(a): was it overwritten?"),
                      expect("result", lambda t: torch.allclose(t["b"], model(b), atol=1e-5),
                             "the second result is not model(b)")])


def check_replay_prediction(fn, sweep, n: int = 300) -> None:
    """02.4: ``fn(sweep, n)`` reads the sweep's straight-line fit of replay time at ``n`` kernels;
    on a GPU the check also replays ``n`` kernels live."""
    with exercise("02.4 predict, then measure", hint=[
                "a straight line through the replay times: which two numbers define it, and on "
                "which rows does the lesson fit it?",
                "in your function: fit replay_us against kernels on the rows with >= 16 kernels, "
                "then read the line at n",
                "a smaller example: (16 kernels, 30 us) and (32 kernels, 46 us) give 1 us per "
                "kernel plus 14 us: 64 kernels predict 78 us"],
            answer="b, a = np.polyfit(kernels, replay_us, 1) on the rows with >= 16 kernels; "
                   "return a + b * n"):
        guess = float(fn(sweep, n))
        rows = [r for r in sweep.rows if r["kernels"] >= 16]
        b, a = np.polyfit([r["kernels"] for r in rows], [r["replay_us"] for r in rows], 1)
        fit = a + b * n
        check(guess, [expect("fit", lambda g: abs(g - fit) <= 0.02 * abs(fit), lambda g: (
            f"you predicted {g:.1f} us for {n} kernels; the fit of the sweep gives {fit:.1f} us"))])
        print(f"  your prediction for one replay of {n} kernels: {guess:.1f} us (from "
              f"{sweep.caption()})")
        if course.runtime().on_gpu:
            got = reference.run("graphs_kernel_sweep", counts=(n,)).rows[0]["replay_us"]
            off = (got - guess) / guess
            print(f"  measured here: {got:.1f} us ({off:+.0%} from your prediction)")
        else:
            print("  on a GPU this check also replays a graph of that many kernels and compares")


def check_serve(fn, forward) -> None:
    """02.5: ``fn(requests)`` is ``forward(request)`` per request, each safe from later replays."""
    with exercise("02.5 diagnose a wrong replay", hint=[
                "read the printout: which input does every output correspond to?",
                "a graph reads the memory it was captured with, and writes the same output memory "
                "at every replay: in your loop, where does each request go, and what do you keep "
                "of each result?",
                "a smaller example: out = []; buf = torch.zeros(1); for v in (1, 2): buf.fill_(v); "
                "out.append(buf) gives [2, 2]; out.append(buf.clone()) gives [1, 2]"],
            answer="for x in requests: static_x.copy_(x); graph.replay(); "
                   "outputs.append(static_y.clone())"):
        reqs = [torch.randn(16, 64, device=course.device()) for _ in range(3)]
        outs = fn(reqs)
        zeros = forward(torch.zeros(16, 64, device=course.device()))
        same = lambda a, b: torch.allclose(a, b, atol=1e-5)  # noqa: E731
        check(outs, [expect("count", lambda o: len(o) == len(reqs),
                            lambda o: f"return one output per request: got {len(o)} for "
                                      f"{len(reqs)}")])
        for k, (out, x) in enumerate(zip(outs, reqs)):
            check(out, [
                expect("input_not_copied", lambda o: not same(o, zeros), (
                    f"output {k} is the layer's output for the zeros it was captured with: the "
                    "replay still reads the old input memory")),
                expect("output_not_cloned",
                       lambda o: k == len(reqs) - 1 or not same(o, forward(reqs[-1])), (
                    f"output {k} equals the LAST request's output: it is the static output tensor, "
                    "overwritten by every later replay")),
                expect("result", lambda o: same(o, forward(x)),
                       f"output {k} is not forward(request {k})")])
