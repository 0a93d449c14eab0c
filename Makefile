# Two entry points (README): `make demo` and `make test`. Both build .venv from nothing first.
# torch is installed alone and pinned first: torch==2.13.0 resolves to the local CPU wheel on our machines;
# any looser spec (or letting another package pull it) downloads the multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install -qq --disable-pip-version-check

.PHONY: setup demo test bench clean

setup: $(VENV)/.ready .venv-sky/.ready

$(VENV)/.ready: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -c constraints.txt -e '.[test]'
	touch $@

# SkyPilot gets its own environment: it pins click<8.2 and uvicorn<0.36, below what transformers' hub client
# and Prefect's server need. The `sky` launcher calls its SDK there (flows/sky_bridge.py).
.venv-sky/.ready: constraints-sky.txt
	$(PYTHON) -m venv .venv-sky
	.venv-sky/bin/pip install -qq --disable-pip-version-check -c constraints-sky.txt skypilot==0.14.1
	touch $@

demo: setup              ## tiny model, CPU, local store, sqlite MLflow, Prefect without a server (~1-2 min)
	$(BIN)/rlflow run configs/tiny.yaml --summary-json rlflow-runs/tiny-demo/summary.json

test: setup              ## every test, the slow end-to-end ones included (real S3/Prefect/MLflow servers)
	$(BIN)/python -m pytest -q tests

bench: setup             ## every benchmark; results go in docs/benchmarks.md
	$(BIN)/python bench/flow_overhead.py
	$(BIN)/python bench/train_step_vs_trl.py
	$(BIN)/python bench/learning_curve_vs_trl.py

clean:
	rm -rf $(VENV) .venv-sky rlflow-store rlflow-runs mlflow.db mlruns
