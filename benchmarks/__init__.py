"""Benchmarks of the gradient-accumulation approaches: step-time overhead, the
accumulation's own kernels in a profiler trace, all-reduces per update, peak memory,
and how they scale with k and with the replica count.

One command runs every comparison in one process and writes the tables and plots that
the docs' Performance page (`docs/performance.md`, hand-written) includes:

    .venv/bin/python -m benchmarks.run            # full size (minutes), docs/performance/
    .venv/bin/python -m benchmarks.run --quick    # smoke size (seconds)
    bash benchmarks/gpu.sh                        # the same on a GPU machine

Modules: `runners` (sizes, model, data, the `Runner` interface), `fit_runners` and
`loop_runners` (one runner per way of training), `approaches` (which runners, in which
group), `measure` (paired, interleaved timing; all-reduce counts; memory), `trace`
(profiler traces: all-reduces and op time by kernel category), `rows` (reading a results
file), `report` (JSON -> markdown tables), `plots` (JSON -> PNG), `run` (the command line).
"""
