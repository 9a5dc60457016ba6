"""Eviction's mechanics: when a request compacts and to what length (planner),
the plan values the scheduler sends the workers (plans), moving kept tokens
(compaction), and where the hot paths run (kernel_dispatch)."""
