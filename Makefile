# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both set up the environment first (.venv, then the Debian data packages they read); a second run reuses it.
# `make setup` sets up the .venv alone (no root): the library, the harness and fine-tuning need nothing more.
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup data demo test bench clean lmms-setup

setup:
	@bash scripts/setup.sh python

data:
	@bash scripts/setup.sh

demo: data
	$(PY) eval/demo.py

test: data
	$(PY) -m pytest -n 2 -q tests

# make bench FAMILY=vit runs one family (vit, shapes, vlm or points); finished runs are reused
bench: data
	$(PY) eval/report.py --suite $(if $(FAMILY),--families $(FAMILY))

# optional: lmms-eval (Video-MME, LongVideoBench, MLVU) in a second environment, .venv-lmms (scripts/setup_lmms.sh)
lmms-setup: setup
	@bash scripts/setup_lmms.sh

clean:
	rm -rf outputs runs .pytest_cache
