# The two commands a fresh machine needs: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast test-heavy compat compat-short bench lint docs browser conformance conformance-minors conformance-tools

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m celery_app.demo

# actionlint for the GitHub workflow, built from the Go module proxy into the venv (the PyPI wrapper has no wheel).
ACTIONLINT_VERSION := v1.7.12
ACTIONLINT := $(VENV)/bin/actionlint-$(ACTIONLINT_VERSION)
GO ?= $(or $(shell command -v go),/usr/local/go/bin/go)

$(ACTIONLINT): | $(VENV)/.installed
	GOBIN=$(CURDIR)/$(VENV)/.actionlint $(GO) install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION)
	mv $(VENV)/.actionlint/actionlint $@ && rmdir $(VENV)/.actionlint

lint: install $(ACTIONLINT)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
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
# CI's quick part of it: the short selection on the four sessions tagged `short`, one per Celery minor.
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
