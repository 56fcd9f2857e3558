"""The lab: the instruments lessons and tests use, never imported by the reference classes.

Tiny deterministic models and data (`data`), weight comparisons and the optimizer table
(`compare`), the training recipes lessons compare (`recipes`, `accumulation`, `mixed`),
graph inspection (`graph`), the call spy (`spy`), the fresh-process runner (`child`) and
what runs on it (`legacy`, `multiworker`, `workers`, `memory`, `resume`).
"""
