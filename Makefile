# Two commands do everything on a fresh machine (Python 3.10+ and, for Mooncake, apt):
#   make demo   set up .venv, start an embedded store and push a KV-page stream through it
#   make test   set up .venv and run the whole test suite
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml requirements/*.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hicache-mc demo

# Two workers, each taking whole modules (their shared stores start once per module); the
# slow tests (live SGLang servers, ~2 GiB each, and the long stress profile) then run alone.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadscope -m "not slow"
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) benchmarks/bench_store.py

clean:
	rm -rf $(VENV) .pytest_cache
