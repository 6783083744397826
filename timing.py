"""
How every speed figure here is taken: a warm-up first, then repeated runs reported as the
median and the min-max. benchmark.py and peers.py share it.
"""

import statistics
import time


def spread(values):
    """Median and min-max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def repeat(fn, reps):
    fn()  # warm-up: first calls pay for allocations and kernel selection
    return [fn() for _ in range(reps)]


def alternate(runs, reps):
    """Seconds per call of each named function, timed in turns (A B C, A B C, ...) after one
    warm-up call each: {name: [seconds] * reps}. Taking turns spreads a shared machine's
    slow moments over all contestants instead of landing on whichever ran then."""
    for fn in runs.values():
        fn()
    seconds = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    return seconds
