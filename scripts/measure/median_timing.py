"""The one timing helper of the scripts in this folder (run as
`python scripts/measure/X.py`, so this folder is on sys.path)."""

import time


def median_ms(fn, *args, reps: int = 30) -> float:
    """Median milliseconds of `reps` calls of fn(*args), after one warm-up call."""
    fn(*args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]
