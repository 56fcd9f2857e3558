"""The Recipes page (docs/recipes.md): every command of its table runs the script it links,
as written, and the script's own check against one big-batch step on one device passes.

The page's first table is the specification: one row per Keras x precision x machines, one
column per way of training (custom loop, `model.fit`, custom `train_step`), 24 cells. A cell
is either a command linked to a recipe, `` [`python NAME.py [--mixed]`](#ID) `` (followed by
`` on [each worker](#several-workers) `` in a several-workers row), or "unsupported: ..."
with a link to why and the alternative. A recipe is the ```python block after the marker
`<!-- recipe: ID -->`, saved as NAME.py (ID with "_" for "-"). The several-workers launch
is the ```bash block after `<!-- launch: several-workers -->`: its `TF_CONFIG`s, on free
ports here.

Each command cell is one test (pytest-xdist spreads them): the recipe runs in a fresh
interpreter (`sys.executable`, tf-keras ones with `TF_USE_LEGACY_KERAS=1`), one process on
this machine's devices (two logical CPUs without GPUs), or two local worker processes with
their `TF_CONFIG` (each its own GPUs, or the CPU only). It passes when every process exits
0 and prints `recipe check passed` last: the script asserted that its weights equal
big-batch training on one device (float32 to 1e-6; mixed_float16, against the same mixed
big batch, to 1e-2 / 1e-3). The last test runs the Keras 3 recipes with mixed_float16 on
two workers and an overflow on one worker only: both skip together (it used to hang both).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distgrad.lab.multiworker import free_ports, visible_gpus, worker_devices

PAGE = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
TEXT = PAGE.read_text(encoding="utf-8")
WAYS = {"custom loop": "loop", "`model.fit`": "fit", "custom `train_step`": "train-step"}
KERAS = {"Keras 3": "keras3", "tf-keras": "tf-keras"}
PRECISIONS = ("float32", "mixed_float16")
MACHINES = ("one machine", "several workers")
RECIPES = dict(re.findall(r"^<!-- recipe: (\S+) -->\n```python\n(.*?)^```$", TEXT,
                          re.MULTILINE | re.DOTALL))
COMMAND = re.compile(r"\[`python (?P<script>\w+\.py)(?P<mixed> --mixed)?`\]"
                     r"\(#(?P<recipe>[\w-]+)\)"
                     r"(?P<workers> on \[each worker\]\(#several-workers\))?")
PASSED = "recipe check passed"
TIMEOUT = "CommunicationOptions(timeout_seconds=300)"  # every recipe's, on several workers
TIMEOUT_S = 360  # one run, all its processes; a hang (e.g. workers that never meet) fails


def table_cells() -> dict:
    """{(way, keras, precision, machines): cell text} of the page's first table."""
    lines = TEXT[TEXT.index("\n| setup |") + 1:].splitlines()
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in itertools.takewhile(lambda line: line.startswith("|"), lines)]
    header, rows = rows[0], rows[2:]  # rows[1] is the |---| line
    cells = {}
    for label, *texts in rows:
        keras, precision, machines = label.split(" · ")
        for way, text in zip(header[1:], texts, strict=True):
            cells[(way, keras, precision, machines)] = text
    return cells


CELLS = table_cells()
RUNS = {key: COMMAND.fullmatch(text) for key, text in CELLS.items()
        if not text.startswith("unsupported:")}


def run_id(key) -> str:
    way, keras, precision, machines = key
    return "-".join([WAYS.get(way, way), KERAS.get(keras, keras), precision,
                     "workers" if machines == "several workers" else "one"])


def launch_configs() -> list[dict]:
    """The `TF_CONFIG`s of the page's several-workers launch block, in task order."""
    block = re.search(r"^<!-- launch: several-workers -->\n```bash\n(.*?)^```$", TEXT,
                      re.MULTILINE | re.DOTALL).group(1)
    return [json.loads(config) for config in re.findall(r"TF_CONFIG='(.*?)'", block, re.DOTALL)]


# -------------------------------------------------------------------------- the page


def test_the_table_has_a_cell_for_every_setup():
    assert set(CELLS) == set(itertools.product(WAYS, KERAS, PRECISIONS, MACHINES))
    assert len(CELLS) == 24


@pytest.mark.parametrize("key", sorted(CELLS), ids=run_id)
def test_a_cell_is_a_command_for_its_own_setup_or_says_why_not_and_what_instead(key):
    way, keras, precision, machines = key
    text = CELLS[key]
    if text.startswith("unsupported:"):
        anchors = re.findall(r"\]\(#([\w-]+)\)", text)
        assert anchors and "instead" in text, text
        for anchor in anchors:  # each link lands on a heading of this page
            assert re.search(rf"^#+ .*\{{#{anchor}\}}$", TEXT, re.MULTILINE), anchor
        return
    match = RUNS[key]
    assert match, f"not a command cell: {text!r}"
    recipe = match["recipe"]
    assert recipe == f"{WAYS[way]}-{KERAS[keras]}", (recipe, key)  # the column's, the row's
    assert recipe in RECIPES and re.search(rf"^## .*\{{#{recipe}\}}$", TEXT, re.MULTILINE)
    assert match["script"] == recipe.replace("-", "_") + ".py"
    assert bool(match["mixed"]) == (precision == "mixed_float16")
    assert bool(match["workers"]) == (machines == "several workers")


def test_every_recipe_on_the_page_is_run_and_fits_the_page():
    assert set(RECIPES) == {match["recipe"] for match in RUNS.values() if match}
    for name, source in RECIPES.items():
        lines = source.splitlines()
        assert sum(1 for line in lines if line.strip()) <= 60, name  # blank lines aside
        assert max(map(len, lines)) <= 100, name  # the content column shows 100 characters
        assert source.count(PASSED) == 1 and "--mixed" in source and "TF_CONFIG" in source
        # Several workers: a collective timeout (the several-workers section says why).
        assert source.count("MultiWorkerMirroredStrategy(") == source.count(TIMEOUT) == 1, name


def test_the_launch_block_gives_each_of_two_workers_its_tf_config():
    block = TEXT[TEXT.index("<!-- launch: several-workers -->"):]
    commands = re.findall(r"' python (\w+\.py)$", block[:block.index("\n```\n")], re.MULTILINE)
    assert len(commands) == 2 and {f"{name.replace('-', '_')}.py" for name in RECIPES} >= {
        *commands}
    configs = launch_configs()
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in (0, 1)]
    assert configs[0]["cluster"] == configs[1]["cluster"]
    assert len(set(configs[0]["cluster"]["worker"])) == 2


# -------------------------------------------------------------------------- the runs


def start(script: Path, args: list, env: dict, name: str) -> tuple:
    out = open(script.with_name(f"{name}.out"), "w+")  # read after the run
    err = open(script.with_name(f"{name}.err"), "w+")
    process = subprocess.Popen([sys.executable, script.name, *args], cwd=script.parent,
                               env=env, stdout=out, stderr=err, start_new_session=True)
    return process, out, err


def finish(processes: list) -> list[tuple]:
    """Wait for every process (all killed, with their children, after TIMEOUT_S); return
    (name, return code or None if killed, stdout, stderr) per process."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p, _, _ in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    results = []
    for process, out, err in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
        else:
            code = process.returncode
        out.seek(0)
        err.seek(0)
        results.append((Path(out.name).stem, code, out.read(), err.read()))
        out.close()
        err.close()
    return results


def run(tmp_path, source: str, script: str, mixed: bool, workers: bool, tf_keras: bool):
    """Save `source` as `script` and run it (`--mixed`), in one process or as two workers;
    return `(results, report)`: `finish`'s tuples, and all their output for a message."""
    (tmp_path / script).write_text(source, encoding="utf-8")
    args = ["--mixed"] if mixed else []
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if tf_keras:
        env["TF_USE_LEGACY_KERAS"] = "1"
    if not workers:
        processes = [start(tmp_path / script, args, env, "one")]
    else:
        configs, ports = launch_configs(), free_ports(2)
        gpus, processes = visible_gpus(), []
        for index, config in enumerate(configs):
            config["cluster"]["worker"] = [f"127.0.0.1:{port}" for port in ports]
            processes.append(start(tmp_path / script, args,
                                   {**env, **worker_devices(index, 2, gpus),
                                    "TF_CONFIG": json.dumps(config)}, f"worker{index}"))
    results = finish(processes)
    report = "\n".join(
        f"--- {name}: " + (f"killed after {TIMEOUT_S} s" if code is None else f"exit {code}")
        + f"\n{out[-2000:]}\n{err[-6000:]}" for name, code, out, err in results)
    return results, report


@pytest.mark.parametrize("key", sorted(k for k, m in RUNS.items() if m), ids=run_id)
def test_the_recipe_runs_and_equals_one_big_batch_step(key, tmp_path):
    match = RUNS[key]
    results, report = run(tmp_path, RECIPES[match["recipe"]], match["script"],
                          bool(match["mixed"]), bool(match["workers"]),
                          KERAS[key[1]] == "tf-keras")
    for _, code, out, _ in results:
        lines = out.strip().splitlines()
        assert code == 0 and lines and lines[-1].startswith(PASSED), report


OUTLIER_REPORT = """
import json
opt = globals().get("optimizer") or model.optimizer
print("RESULT " + json.dumps({
    "scale": float(opt.dynamic_scale.numpy()), "iterations": int(opt.iterations.numpy()),
    "skipped": int(opt.skipped_steps.numpy()) if hasattr(opt, "skipped_steps") else None,
    "weights": [w.tolist() for w in model.get_weights()]}))
"""


@pytest.mark.parametrize("way", ["loop", "fit", "train-step"])
def test_keras3_mixed_on_two_workers_skips_together_when_one_worker_overflows(way, tmp_path):
    # The Keras 3 mixed_float16 several-workers cells: the recipe with --mixed, one outlier
    # target (its float16 gradient overflows) in one worker's part of a batch (a worker gets
    # a contiguous part of every batch), and a collective timeout of 30 s. The overflow
    # decision is global (one all-reduce of the replicas' flags), so both workers skip the
    # same step(s) and end with the same weights as the same run on one machine (two
    # replicas there too, the same split), which skips the same micro-batch. Before that,
    # the worker that overflowed skipped while the other waited in the gradient all-reduce
    # until `Collective has timed out`.
    source = RECIPES[f"{way}-keras3"]
    assert source.count(TIMEOUT) == 1
    source = source.replace(TIMEOUT, "CommunicationOptions(timeout_seconds=30)")
    source, count = re.subn(r"^(y = .*)$", r"\1\ny[MICRO + MICRO // 2 + 1] = 1e4", source,
                            flags=re.MULTILINE)
    assert count == 1
    source = source[:source.index("# Check:")] + OUTLIER_REPORT
    script = f"{way.replace('-', '_')}_keras3.py"
    runs = {}
    for workers in (True, False):
        results, report = run(tmp_path, source, script, mixed=True, workers=workers,
                              tf_keras=False)
        for name, code, out, _ in results:
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert code == 0 and len(lines) == 1, report
            runs[name] = json.loads(lines[0][len("RESULT "):])
    assert set(runs) == {"worker0", "worker1", "one"}
    one = runs["one"]
    assert one["scale"] < 2.0 ** 15, one["scale"]  # the outlier overflowed: a skip at least
    for name in ("worker0", "worker1"):
        ours = runs[name]
        assert (ours["scale"], ours["iterations"], ours["skipped"]) == (
            one["scale"], one["iterations"], one["skipped"]), (name, ours["scale"], one["scale"])
        for w, v in zip(ours["weights"], one["weights"], strict=True):
            np.testing.assert_allclose(w, v, rtol=1e-6, atol=1e-6)
    for w, v in zip(runs["worker0"]["weights"], runs["worker1"]["weights"], strict=True):
        np.testing.assert_array_equal(w, v)  # one model, replicated: bit for bit
