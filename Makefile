# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both set up the environment first (Debian data packages + .venv); a second run reuses it.
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test bench clean lmms-setup

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) eval/demo.py

test: setup
	$(PY) -m pytest -n 2 -q tests

# make bench FAMILY=vit runs one family (vit, shapes, vlm or points); finished runs are reused
bench: setup
	$(PY) eval/report.py --suite $(if $(FAMILY),--families $(FAMILY))

# optional: lmms-eval (Video-MME, LongVideoBench, MLVU) in a second environment, .venv-lmms (scripts/setup_lmms.sh)
lmms-setup: setup
	@bash scripts/setup_lmms.sh

clean:
	rm -rf outputs runs .pytest_cache
