"""Lesson 01's check: exercise 01, the crossover found from the sweep's rows."""
from __future__ import annotations

from course.core.checks import exercise
from course.core.harness import check, expect

NAME = "01 crossover"


def check_crossover(fn, sweep) -> None:
    """01: ``fn(rows)`` returns the crossover size (bytes) of ``sweep``'s rows."""
    with exercise(NAME, hint=[
                "the launch cost is one number for the whole sweep: which column of the rows is "
                "the host's time to issue a launch, and which statistic is not thrown off by a few "
                "slow launches?",
                "in crossover(rows): compute that one launch cost first, then walk the rows from "
                "the smallest tensor to the largest and stop at the first whose kernel time "
                "reaches it",
                "a smaller example: kernel times 2, 3, 9 and 12 us for 1, 2, 4 and 8 KB, and a "
                "launch cost of 8 us: the crossover is 4 KB, the first size whose kernel takes at "
                "least as long as its launch"],
            answer="launch = statistics.median(r['host_enqueue_us'] for r in rows); for r in "
                   "sorted(rows, key=lambda r: r['bytes']): if r['kernel_exec_us'] >= launch: "
                   "return r['bytes']"):
        trace = {"got": fn(sweep.rows), "want": sweep.value("crossover_bytes")}
        check(trace, [expect("crossover", lambda t: t["got"] == t["want"], lambda t: (
            f"your crossover is {t['got']!r} bytes but the data say {t['want']!r}: take the median "
            "host_enqueue_us as the launch cost, then the smallest 'bytes' whose kernel_exec_us "
            "reaches it"))])
