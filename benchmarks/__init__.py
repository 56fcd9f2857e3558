"""Benchmarks of the gradient-accumulation approaches: step-time overhead, all-reduces
per update, peak memory, and how they scale with k and with the replica count.

One command runs every comparison in one process and writes the docs' Performance page:

    .venv/bin/python -m benchmarks.run            # full size (minutes), docs/performance/
    .venv/bin/python -m benchmarks.run --quick    # smoke size (seconds)
    bash benchmarks/gpu.sh                        # the same on a GPU machine

Modules: `approaches` (one runner per way of training, all on the same MLP and data),
`measure` (paired, interleaved timing; all-reduce counts from the graph, derived, and
from a profiler trace; allocator memory), `report` (JSON -> markdown tables, plots and
`docs/performance.md`), `run` (the command line).
"""
