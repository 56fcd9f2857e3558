"""The lab: the instruments lessons and tests use, never imported by the reference classes.

Tiny deterministic models and data (`data`), weight comparisons and the optimizer table
(`compare`), the training recipes lessons compare (`recipes`, `accumulation`, `mixed`),
graph inspection (`graph`), the call spy (`spy`), the simulated GPU+XLA path
(`xla_path`), rendering on the page (`display`), the one argument guard (`args`), the
child-process runner (`child`; on Linux its children are forked by `fork_server`, which
runs a named module as `python -m` would and never imports `child`) and what runs on it
(`tf_keras_runner` with the tf-keras recipes of `tf_keras_fit`, `local_cluster`,
`workers`, `memory`, `resume`, `custom_loop_resume`, and `preemption` on the cluster
manager of `cluster_manager`).
"""
