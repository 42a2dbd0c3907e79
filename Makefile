# Developer entry points. CI runs `.ci/run` (the whole suite, short forms); these targets are for people.
#
#   make lint       ruff and mypy as CI runs them (.ci/lint; configured in pyproject.toml), before the tests
#   make test       the whole suite as CI runs it: soak of 1,000 sessions, chaos and fuzzing in their short forms
#   make test-long  adds the long versions (SANDPOOL_LONG=1): soak of 10,000 sessions, every chaos fault
#                   repeated 4 times over 400 sessions, 20x the fuzzing examples, randomised instead of
#                   derandomised, the Redis primary killed under load three times over (failing over and back),
#                   a Redis Cluster node failover
#   make resilience the resilience and security suites only (tests/reliability, tests/security, tests/fuzz)
#   make bench      the benchmarks in bench/ (loopback figures; they mean something only next to the machine)

PYTHON ?= python
PYTEST ?= $(PYTHON) -m pytest
RESILIENCE = tests/reliability tests/security tests/fuzz

.PHONY: lint test test-long resilience resilience-long bench

lint:
	PYTHON=$(PYTHON) .ci/lint

test:
	$(PYTEST) -q

test-long:
	SANDPOOL_LONG=1 $(PYTEST) -q

resilience:
	$(PYTEST) -q $(RESILIENCE)

resilience-long:
	SANDPOOL_LONG=1 SANDPOOL_SOAK_SESSIONS=$${SANDPOOL_SOAK_SESSIONS:-10000} $(PYTEST) -q -s $(RESILIENCE)

bench:
	$(PYTHON) bench/agent_bench.py
	$(PYTHON) bench/refill.py
	$(PYTHON) bench/proxy_overhead.py
	$(PYTHON) bench/load.py --start-up --auth --duration 10
