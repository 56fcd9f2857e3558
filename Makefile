# Two entry points (see README): `make course` and `make test`. Both create .venv and
# install the project from pyproject.toml first, so a fresh clone needs only Python.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Executed copies of the lessons land here; mkdocs renders them with their outputs.
EXECUTED := docs/lessons
NOTEBOOK_TIMEOUT ?= 900
# A pytest run that collects nothing exits 5; record each run's status for .ci/run.
PYTEST_STATUS := build/pytest-status

.PHONY: course test install lessons site serve unit clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[legacy,dev]'
	touch $(STAMP)

# Execute every lesson (nbmake writes the outputs into the copies), then build the site.
lessons: install
	mkdir -p $(EXECUTED) build
	rm -f $(EXECUTED)/*.ipynb
	cp notebooks/*.ipynb $(EXECUTED)/
	$(PY) -m pytest --nbmake --nbmake-timeout=$(NOTEBOOK_TIMEOUT) --overwrite -p no:cacheprovider \
	  $(EXECUTED) ; echo $$? >> $(PYTEST_STATUS); test "$$(tail -n1 $(PYTEST_STATUS))" = 0

site: install
	$(PY) -m mkdocs build --strict --site-dir site

course: lessons site
	@echo ""
	@echo "Course executed on: $$($(PY) -c 'import distgrad,json; print(json.dumps(distgrad.environment_report()))' 2>/dev/null)"
	@echo "Site built in site/. Open site/index.html, or run 'make serve' for http://127.0.0.1:8000"

serve: install
	$(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

unit: install
	mkdir -p build
	$(PY) -m pytest tests ; echo $$? >> $(PYTEST_STATUS); test "$$(tail -n1 $(PYTEST_STATUS))" = 0

# Unit tests (incl. the .py/.ipynb pairing check), every lesson through nbmake, strict docs build.
test: install
	mkdir -p build && rm -f $(PYTEST_STATUS)
	$(MAKE) unit
	$(MAKE) lessons
	$(MAKE) site

clean:
	rm -rf site build $(EXECUTED)/*.ipynb
