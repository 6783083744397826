"""
How every speed figure here is taken: a warm-up first, then repeated runs reported as the
median and the min-max; contestants that are compared take turns.
"""

import statistics
import time


def spread(values):
    """Median and min-max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def repeat(fn, reps):
    fn()  # warm-up: first calls pay for allocations and kernel selection
    return [fn() for _ in range(reps)]


def timed(fn):
    """(fn(), the seconds it took)."""
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def alternate(runs, reps):
    """What each named function returns, called in turns (A B C, A B C, ...) after one
    warm-up call each: {name: [result] * reps}. Taking turns spreads a shared machine's
    slow moments over all contestants instead of landing on whichever ran then. Each
    function times itself (its result holds its seconds), so that it can leave out work
    that is not the thing measured, such as a compile."""
    for fn in runs.values():
        fn()
    results = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            results[name].append(fn())
    return results
