"""The Recipes page (docs/recipes.md): every command of its table runs the script it links,
as written, and the script's own check against one big-batch step on one device passes.

The page's main table (header `| setup |`) is the specification: one row per Keras x
precision x machines, one column per way of training (custom loop, `model.fit`, your own
`train_step`, distgrad's `MicroBatching`), 32 cells. A cell is either a command linked to a
recipe, `` [`python NAME.py [--mixed]`](#ID) `` (followed by
`` on [each worker](#several-workers) `` in a several-workers row), or "unsupported: ..."
with a link to why and the alternative. A recipe is the ```python block after the marker
`<!-- recipe: ID -->`, saved as NAME.py (ID with "_" for "-"). The several-workers launch
is the ```bash block after `<!-- launch: several-workers -->`: its `TF_CONFIG`s, on free
ports here.

Beside the runs, the page's other claims: the no-accumulation row (lesson 01's fix), each
recipe's **Floor** line, the table of what each recipe does with the epoch's leftover
micro-batches (against its code, its check and lesson 02's fix), and the Keras 2 -> Keras 3
loss-scale table (Keras 3 here; tf-keras in a `run_tf_keras` child, `recipes_children.py`).

Each command cell is one test (pytest-xdist spreads them): the recipe runs as `python
NAME.py` would, in a process of its own (tf-keras ones with `TF_USE_LEGACY_KERAS=1`), one on
this machine's devices (two logical CPUs without GPUs), or two local worker processes with
their `TF_CONFIG` (each its own GPUs, or the CPU only). It passes when every process exits
0 and prints `recipe check passed` last: the script asserted that its weights equal
big-batch training on one device (float32 to 1e-6; mixed_float16, against the same mixed
big batch, up to the float16 bound of its updates, 2n·2⁻¹¹/(1 − n·2⁻¹¹)). The outlier
test runs the Keras 3 recipes with mixed_float16 on two workers and an overflow on one
worker only: both skip together (it used to hang both).

Each process runs as `tests/script_runs.py` starts it: forked from a server that imported
TensorFlow with the process's own environment and started no runtime, the script then run
as `__main__` with its own `sys.argv`, `sys.path`, directory, devices and `TF_CONFIG` (48
processes, 3 s of CPU less each); `DISTGRAD_FORK_SERVER=0` makes each a fresh interpreter.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import script_runs

from distgrad_course.lab.local_cluster import free_ports, visible_gpus, worker_devices

PAGE = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
TEXT = PAGE.read_text(encoding="utf-8")
WAYS = {"custom loop": "loop", "`model.fit`": "fit", "your own `train_step`": "own-train-step",
        "`MicroBatching` `train_step`": "micro-batching"}
KERAS = {"Keras 3": "keras3", "tf-keras": "tf-keras"}
# The recipe a column links, per Keras (None: unsupported). tf-keras' own `train_step` and
# Keras 3's `MicroBatching` keep the anchors they had before the own-train_step column.
RECIPE_OF = {
    ("custom loop", "Keras 3"): "loop-keras3", ("custom loop", "tf-keras"): "loop-tf-keras",
    ("`model.fit`", "Keras 3"): "fit-keras3", ("`model.fit`", "tf-keras"): "fit-tf-keras",
    ("your own `train_step`", "Keras 3"): "own-train-step-keras3",
    ("your own `train_step`", "tf-keras"): "train-step-tf-keras",
    ("`MicroBatching` `train_step`", "Keras 3"): "train-step-keras3",
    ("`MicroBatching` `train_step`", "tf-keras"): None,
}
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
    """{(way, keras, precision, machines): cell text} of the main table (`| setup |`)."""
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
    assert len(CELLS) == 32


@pytest.mark.parametrize("key", sorted(CELLS), ids=run_id)
def test_a_cell_is_a_command_for_its_own_setup_or_says_why_not_and_what_instead(key):
    way, keras, precision, machines = key
    text = CELLS[key]
    if text.startswith("unsupported:"):
        assert RECIPE_OF[(way, keras)] is None, key
        anchors = re.findall(r"\]\(#([\w-]+)\)", text)
        assert anchors and "instead" in text, text
        for anchor in anchors:  # each link lands on a heading of this page
            assert re.search(rf"^#+ .*\{{#{anchor}\}}$", TEXT, re.MULTILINE), anchor
        return
    match = RUNS[key]
    assert match, f"not a command cell: {text!r}"
    recipe = match["recipe"]
    assert recipe == RECIPE_OF[(way, keras)], (recipe, key)  # the column's, the row's
    assert recipe in RECIPES and re.search(rf"^## .*\{{#{recipe}\}}$", TEXT, re.MULTILINE)
    assert match["script"] == recipe.replace("-", "_") + ".py"
    assert bool(match["mixed"]) == (precision == "mixed_float16")
    assert bool(match["workers"]) == (machines == "several workers")


def test_every_recipe_on_the_page_is_run_and_fits_the_page():
    assert set(RECIPES) == {match["recipe"] for match in RUNS.values() if match}
    for name, source in RECIPES.items():
        lines = source.splitlines()
        # One screen and a little: blank lines aside, 64 (the float16 bound of the check and
        # the collective timeout take 4 lines of them).
        assert sum(1 for line in lines if line.strip()) <= 64, name
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
    """`python SCRIPT ARGS` in the script's folder (`script_runs`), its output in files
    read after the run."""
    out, err = script.with_name(f"{name}.out"), script.with_name(f"{name}.err")
    return script_runs.start(script.name, args, env, script.parent, out, err), out, err


def finish(processes: list) -> list[tuple]:
    """Wait for every process (all killed, with their children, after TIMEOUT_S); return
    (name, return code or None if killed, stdout, stderr) per process."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p, _, _ in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    results = []
    for process, out, err in processes:
        code = process.poll()
        script_runs.kill(process)
        results.append((out.stem, code, out.read_text(), err.read_text()))
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


@pytest.mark.parametrize("way", ["loop", "fit", "own-train-step", "train-step"])
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


# -------------------------------------------------------------------------- the page's claims

ROOT = PAGE.parents[1]
LESSON_01 = (ROOT / "notebooks" / "01_where_gradients_sync.py").read_text(encoding="utf-8")
LESSON_02 = (ROOT / "notebooks" / "02_accumulate_in_custom_loop.py").read_text(encoding="utf-8")
# The tf-keras recipes' floor: the oldest TensorFlow whose matrix cell ran them (TF 2.16).
TF_KERAS_FLOOR = "2.15"


def cell(lesson: str, tag: str) -> str:
    """The code of a lesson's cell tagged `tag` (jupytext percent format)."""
    start = lesson.index(f'# %% tags=["{tag}"]\n')
    return lesson[start:].split("\n# %%", 1)[0]


def slug(heading: str) -> str:
    """The anchor the site gives a lesson heading (Python-Markdown's toc slugify)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def section(recipe: str) -> str:
    """The page's text from the heading `{#recipe}` to the next `## ` heading."""
    start = re.search(rf"^## .*\{{#{recipe}\}}$", TEXT, re.MULTILINE).start()
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start:end if end > 0 else None]


def test_the_no_accumulation_row_points_to_lesson_01s_fix_which_checks_against_one_device():
    row = next(line for line in TEXT.splitlines() if line.startswith("| no accumulation (k = 1)"))
    links = re.findall(r"\]\(lessons/01_where_gradients_sync\.ipynb#([\w-]+)\)", row)
    headings = {slug(h) for h in re.findall(r"^# #+ (.*)$", LESSON_01, re.MULTILINE)}
    assert links and set(links) <= headings, (links, sorted(headings))
    assert "1-the-fix" in links and "right as written" in row and "1e-6" in row
    fix, check = cell(LESSON_01, "fix"), cell(LESSON_01, "check")
    # The tutorial's shape: per-replica loss over the global batch, apply_gradients in the
    # replica step, one update per batch (no buffers); the check at float32 tolerance.
    assert "global_batch_size=GLOBAL_BATCH" in fix and "strategy.run(train_step" in fix
    assert re.search(r"def train_step\(.*\n(?:    .*\n)*    optimizer\.apply_gradients\(", fix)
    assert "assign_add" not in fix
    assert "rtol=1e-6, atol=1e-6" in check


def test_every_recipe_states_the_floor_its_imports_and_the_version_matrix_give():
    from distgrad import mixed_precision, optimizer, train_step

    needed = {(m.NEEDED["tensorflow"], m.NEEDED["keras"])
              for m in (optimizer, mixed_precision, train_step)}
    assert len(needed) == 1  # the Keras 3 classes agree
    (tf_floor, keras_floor), = needed
    keras3 = (f"**Floor:** TensorFlow ≥ {'.'.join(map(str, tf_floor))} and Keras ≥ "
              f"{'.'.join(map(str, keras_floor))}: distgrad's Keras 3 classes refuse older")
    # tf-keras: a pair the version matrix ran with tf-keras (docs/versions.md's table), in a
    # cell whose every tf-keras recipe run passed; TF_KERAS_FLOOR moves down when a matrix
    # cell ran them lower.
    versions = (ROOT / "docs" / "versions.md").read_text(encoding="utf-8")
    row = next(line for line in versions.splitlines() if line.startswith("| tf-keras"))
    assert re.search(rf"\b{re.escape(TF_KERAS_FLOOR)}\.\d+\b", row.split("|")[3]), row
    matrix = json.loads((ROOT / "docs" / "versions" / "matrix.json").read_text())
    ran = matrix[f"tf{TF_KERAS_FLOOR}"]["per_test"]
    statuses = {test: result["status"] for test, result in ran.items()
                if "runs_and_equals_one_big_batch_step[" in test and "-tf-keras-" in test}
    tf_keras_recipes = [recipe for recipe in RECIPES if recipe.endswith("tf-keras")]
    assert len(statuses) == len(tf_keras_recipes) * len(PRECISIONS) * 2, sorted(statuses)
    assert set(statuses.values()) == {"pass"}, statuses  # one machine and two workers each
    tf_keras = (f"**Floor:** TensorFlow {TF_KERAS_FLOOR} with tf-keras {TF_KERAS_FLOOR}, "
                "the oldest pair")
    for recipe in RECIPES:
        floors = [line for line in section(recipe).splitlines() if line.startswith("**Floor:**")]
        assert len(floors) == 1, recipe
        assert floors[0].startswith(tf_keras if recipe.endswith("tf-keras") else keras3), (
            recipe, floors[0])


LEFTOVERS = re.compile(r"^\| \[.*?\]\(#(?P<recipe>[\w-]+)\) \| (?P<what>flush|drop|carry)\b"
                       r".*? \| (?P<why>.*) \|$", re.MULTILINE)


def test_each_recipe_does_with_the_epochs_leftover_what_the_leftover_table_says():
    block = TEXT[TEXT.index("{#leftover-micro-batches}"):TEXT.index("{#loss-scale-keras2-keras3}")]
    rows = {m["recipe"]: (m["what"], m["why"]) for m in LEFTOVERS.finditer(block)}
    assert set(rows) == set(RECIPES)
    # Lesson 02's fix applies the leftover as one smaller update (what "as lesson 02" says).
    assert re.search(r"if step % K != K - 1:.*\n +apply\(\)", cell(LESSON_02, "fix"))
    for recipe, (what, why) in rows.items():
        source = RECIPES[recipe]
        flushes = ('AccumulationCallback("flush")' in source
                   or re.search(r"if step % K == K - 1 or \(step \+ 1\) \* MICRO == len\(x\):"
                                r".*\n +apply_step\(\)", source))
        assert bool(flushes) == (what == "flush"), recipe
        if what == "flush":  # the check: every example, the last big batch smaller
            assert "big.fit(x, y, batch_size=K * MICRO, epochs=2" in source, recipe
            assert "lesson 02" in why, recipe
        elif what == "drop":  # batches of a whole update; the check fits the same dataset
            assert ".batch(K * MICRO, drop_remainder=True)" in source, recipe
            assert "big.fit(data, epochs=2)" in source, recipe
        else:  # carry: the check is one stream of big batches over both epochs
            assert "big.fit(data.repeat(2).unbatch().batch(K * MICRO, drop_remainder=True))" \
                in source, recipe
            assert "AccumulatingOptimizer" in source and recipe.endswith("tf-keras"), recipe
        # The recipe's own text says the same.
        words = {"flush": "smaller update", "drop": "dropped", "carry": "carry"}[what]
        assert words in section(recipe).split("<!-- recipe:")[0].replace("\n", " "), recipe


def loss_scale_row(what: str) -> tuple[str, str]:
    """(tf-keras cell, Keras 3 cell) of the loss-scale table's row `what`."""
    block = TEXT[TEXT.index("{#loss-scale-keras2-keras3}"):TEXT.index("## Limits")]
    line = next(line for line in block.splitlines() if line.startswith(f"| {what} |"))
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    assert len(cells) == 3, line
    return cells[1], cells[2]


def test_keras3_loss_scale_calls_are_the_ones_the_table_names(strategy2):
    import inspect

    import keras
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    import distgrad

    wrapper, scale, unscale, apply = (loss_scale_row(w)[1] for w in (
        "the wrapper", "scale the loss", "unscale the gradients", "apply"))
    assert "initial_scale=2.0**15, dynamic_growth_steps=2000" in wrapper
    lso = keras.optimizers.LossScaleOptimizer
    assert keras.mixed_precision.LossScaleOptimizer is lso
    defaults = inspect.signature(lso).parameters
    assert (defaults["initial_scale"].default, defaults["dynamic_growth_steps"].default) == (
        2.0**15, 2000)
    assert issubclass(distgrad.AllReplicasFiniteLossScaleOptimizer, lso)
    for name in ("get_scaled_loss", "get_unscaled_gradients"):  # "(no ...)" in the table
        assert f"no `{name}`" in scale + unscale and not hasattr(lso, name)
    # Keras' own train_step scales with scale_loss (the own-train_step recipe's shape).
    assert "self.optimizer.scale_loss(loss)" in inspect.getsource(TensorFlowTrainer.train_step)

    opt = lso(keras.optimizers.SGD(1.0), initial_scale=8.0, dynamic_growth_steps=2)
    variable = keras.Variable(1.0)
    assert float(opt.scale_loss(tf.constant(2.0))) == 16.0  # before build: initial_scale
    opt.apply([tf.constant(4.0)], [variable])  # 8 x 0.5: apply divides by the scale
    assert float(variable.numpy()) == 0.5 and int(opt.step_counter.numpy()) == 1
    assert float(opt.scale_loss(tf.constant(2.0))) == 2.0 * float(opt.dynamic_scale.numpy())
    opt.apply_gradients([(tf.constant(0.0), variable)])  # 2 finite steps: the scale doubles
    assert (float(opt.dynamic_scale.numpy()), int(opt.step_counter.numpy())) == (16.0, 0)
    opt.apply([tf.constant(float("inf"))], [variable])  # skipped, the scale halves
    assert (float(variable.numpy()), float(opt.dynamic_scale.numpy())) == (0.5, 8.0)
    assert "`opt.dynamic_scale`" in loss_scale_row("the scale now")[1]
    assert "`opt.step_counter`" in loss_scale_row(
        "finite steps since it last changed (it doubles at `dynamic_growth_steps`)")[1]
    assert "`opt.apply(grads, variables)`" in apply

    # Without a loss scale `scale_loss` returns the loss (float32 runs the same train_step).
    loss = tf.constant(3.0)
    assert keras.optimizers.Adam().scale_loss(loss) is loss
    with strategy2.scope():
        accumulating = distgrad.AccumulatingOptimizer(keras.optimizers.Adam(), 2)
    assert accumulating.scale_loss(loss) is loss
    # A fixed scale: refused by the wrapper; the inner optimizer's loss_scale_factor instead.
    fixed = loss_scale_row("a fixed scale")[1]
    with pytest.raises(ValueError, match="loss_scale_factor"):
        lso(keras.optimizers.SGD(1.0), dynamic=False)
    assert "`ValueError`" in fixed and "loss_scale_factor=S" in fixed
    sgd, variable = keras.optimizers.SGD(1.0, loss_scale_factor=4.0), keras.Variable(1.0)
    assert float(sgd.scale_loss(tf.constant(2.0))) == 8.0
    sgd.apply([tf.constant(8.0)], [variable])  # divided by 4
    assert float(variable.numpy()) == -1.0
    sgd.apply([tf.constant(float("inf"))], [variable])  # not skipped
    assert float(variable.numpy()) == float("-inf")
    # compile under mixed_float16 wraps the optimizer.
    assert loss_scale_row("`compile` under `mixed_float16`")[1] == (
        "wraps it in `LossScaleOptimizer`")
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert isinstance(model.optimizer, lso)
    # The own-train_step recipe logs compute_loss x replicas: Keras' losses divide by them.
    per_replica = strategy2.run(lambda: keras.losses.MeanSquaredError()(
        tf.constant([[1.0], [3.0]]), tf.constant([[0.0], [0.0]])))
    assert [float(v) for v in strategy2.experimental_local_results(per_replica)] == [2.5, 2.5]


def test_tf_keras_loss_scale_calls_are_the_ones_the_table_names():
    from distgrad_course.lab.tf_keras_runner import run_tf_keras

    seen = run_tf_keras("recipes_children:tf_keras_loss_scale",
                      env={"PYTHONPATH": str(Path(__file__).parent)}).value
    wrapper, scale, unscale, apply = (loss_scale_row(w)[0] for w in (
        "the wrapper", "scale the loss", "unscale the gradients", "apply"))
    assert "dynamic=True, initial_scale=None, dynamic_growth_steps=None" in wrapper
    assert "2<sup>15</sup> and 2000" in wrapper
    assert seen["default"] == [True, 2.0**15, 2000, 2.0**15]
    assert "`opt.get_scaled_loss(loss)` (no `scale_loss`)" == scale
    assert seen["scaled_loss"] == 16.0 and seen["has_scale_loss"] is False
    assert "`apply_gradients` does not divide" in unscale
    assert seen["unscaled_gradients"] == [2.0] and seen["after_apply"] == 0.5
    assert "halves the scale" in apply
    assert (seen["counter_after_one"], seen["scale_after_growth"],
            seen["counter_after_growth"]) == (1, 16.0, 0)  # dynamic_counter; doubled at 2
    assert seen["after_inf"] == [0.5, 8.0]  # skipped, halved
    assert "dynamic=False, initial_scale=S" in loss_scale_row("a fixed scale")[0]
    assert seen["fixed"] == [False, 4.0, 4.0]
    assert seen["compiled"] is True
    # The leftover table's "why" for the tf-keras recipes, and the MicroBatching column.
    assert seen["tf_keras_flush"] == [False, False]
    assert seen["tf_keras_micro_batching"] is False


def test_own_train_step_mixed_check_fails_without_scale_loss(tmp_path):
    # The recipe's mixed check can tell: without scale_loss, apply still divides by the
    # scale (2**15), and the weights move far less than the mixed big batch's.
    source = RECIPES["own-train-step-keras3"]
    old = "scaled = self.optimizer.scale_loss(loss)"
    assert source.count(old) == 1
    results, report = run(tmp_path, source.replace(old, "scaled = loss"),
                          "own_train_step_keras3.py", mixed=True, workers=False, tf_keras=False)
    (_, code, out, err), = results
    assert code != 0 and PASSED not in out and "Not equal to tolerance" in err, report
