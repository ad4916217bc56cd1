# bnexp: set-up, tests, demo. Every install step lives here (CI runs `make test`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BNEXP := $(VENV)/bin/bnexp
STAMP := $(VENV)/.bnexp-installed

.PHONY: install test demo clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

# The main job, briefly. Exit code 3 means CIFAR-10 is not on disk and cannot be
# downloaded; only then does the demo fall back to real digits (scikit-learn's bundled
# images): the CBN claim, BN vs CBN with sigmoid and ReLU, and its table; it says so.
demo: install
	@$(BNEXP) train model=resnet20 norm=bn act=relu trainer.epochs=1 data.root=data; \
	rc=$$?; \
	if [ $$rc -eq 3 ]; then \
		echo ""; \
		echo "=================================================================="; \
		echo " make demo: CIFAR-10 is unavailable (see the message above)."; \
		echo " FALLING BACK TO REAL DIGITS (scikit-learn's bundled 8x8 images):"; \
		echo " the CBN claim, BN vs CBN with sigmoid and ReLU, 3 seeds each."; \
		echo " These are digits numbers, NOT CIFAR-10 numbers."; \
		echo "=================================================================="; \
		echo ""; \
		$(BNEXP) claims cbn act=sigmoid,relu; \
	else exit $$rc; fi

clean:
	rm -rf $(VENV) build *.egg-info

# ---- Reproducing the papers (docs/experiments.md) ----------------------------------
# `make reproduce-<paper>-<name>` runs the preset configs/experiment/<paper>/<name>.yaml
# through `bnexp reproduce` (count and cost, the sweep, then the table), e.g.
#   make reproduce-table1 SCALE=quick      CBN Table 1 at toy scale on a CPU
#   make reproduce-bnp-fc FORCE=1          full scale even without a GPU
#   make reproduce-cbn-table3 TUNE_SEEDS=2 rho grid on 2 seeds, winners on all
# ARGS passes Hydra overrides, e.g. ARGS='hydra/launcher=joblib data.root=/datasets'.
# `make reproduce-list` prints every target.
SCALE ?= full
REPRODUCE_ARGS = scale=$(SCALE) $(if $(FORCE),force=true) $(if $(TUNE_SEEDS),tune_seeds=$(TUNE_SEEDS)) $(ARGS)

.PHONY: reproduce-table1 reproduce-list

reproduce-table1: reproduce-cbn-table1

reproduce-list:
	@for f in configs/experiment/*/*.yaml; do p=$${f#configs/experiment/}; p=$${p%.yaml}; \
		echo "make reproduce-$${p%%/*}-$${p#*/}"; done

reproduce-%: install
	$(BNEXP) reproduce $(subst -,/,$*) $(REPRODUCE_ARGS)
