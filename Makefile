# bnexp: set-up, tests, demo. Every install step lives here (CI runs `make test`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BNEXP := $(VENV)/bin/bnexp
STAMP := $(VENV)/.bnexp-installed

.PHONY: install test lint tex slurm demo clean wheels install-offline gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Tests in parallel processes (pytest-xdist), one per core; the SLURM cluster's tests share
# one process (their xdist_group). `pytest` alone runs them one at a time.
test: install
	$(PY) -m pytest -q -n auto --dist loadgroup

# ruff, configured in pyproject.toml ([tool.ruff]); CI runs it before the tests.
lint: install
	$(PY) -m ruff check .

# pdflatex with booktabs, for the test that compiles `bnexp table format=latex` (it is
# skipped where they are missing). Debian or Ubuntu, as root; CI runs it before the tests.
TEX_PACKAGES := texlive-latex-base texlive-latex-recommended

tex:
	@if command -v pdflatex >/dev/null && kpsewhich booktabs.sty >/dev/null 2>&1; then \
		echo "pdflatex and booktabs are installed"; else \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(TEX_PACKAGES) >/dev/null && kpsewhich booktabs.sty; fi

# A one-node SLURM cluster on this machine (slurmctld, slurmd and munge from Debian's
# packages, /etc/slurm/slurm.conf from scripts/slurm/slurm.conf.in), for the tests marked
# `slurm` (skipped where it is not up). Debian or Ubuntu, as root; it starts the daemons each
# time they are not running, and does nothing when the cluster is up. CI runs it before the
# tests (docs/distributed.md).
slurm:
	scripts/slurm/up.sh

# The main job (README, "The main command") for one epoch. Exit code 3 means CIFAR-10 is not on disk and cannot be
# downloaded; only then does the demo fall back to real digits (scikit-learn's bundled
# images): the CBN claim, BN vs CBN with sigmoid and ReLU, and its table; it says so.
demo: install
	@$(BNEXP) train model=resnet20 norm=cbn act=sigmoid trainer.epochs=1; \
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

# ---- A GPU node without internet (docs/speed.md) -----------------------------------
# `make wheels`, where pip can reach an index, with the node's Python version: every
# dependency except torch and torchvision (plus setuptools and wheel) into wheels/. Copy
# the clone to the node; there `make install-offline` installs from wheels/ alone into a
# venv that sees the node's own CUDA PyTorch (>= 2.11) and leaves it as it is, and
# `make gpu-check` validates bnexp on its GPU (results/gpu-check/).
WHEELS ?= wheels

wheels:
	$(PYTHON) -m pip wheel -w $(WHEELS) setuptools wheel $$($(PYTHON) scripts/offline_requirements.py)

install-offline:
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PYTHON) scripts/see_node_packages.py $(VENV)
	@$(PY) -c "import torch, torchvision; print('using the installed torch', torch.__version__, 'CUDA', torch.version.cuda)" \
		|| { echo "install-offline keeps the node's PyTorch, and found none: install torch>=2.11 and torchvision>=0.26 first"; exit 1; }
	$(PY) -m pip install --no-index --find-links $(WHEELS) setuptools wheel $$($(PYTHON) scripts/offline_requirements.py)
	$(PY) -m pip install --no-index --no-deps --no-build-isolation -e .
	touch $(STAMP)

# On a machine with wheels/ the offline install, otherwise the usual one.
# CHECKS names some of the checks (e.g. CHECKS="tests bench-step"); all of them by default.
gpu-check: $(if $(wildcard $(WHEELS)/*.whl),install-offline,install)
	$(PY) -m bnexp.bench.gpu_check $(CHECKS)

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
