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
# downloaded; only then does the demo fall back to synthetic data, and it says so.
demo: install
	@$(BNEXP) train model=resnet20 norm=bn act=relu trainer.epochs=1 data.root=data; \
	rc=$$?; \
	if [ $$rc -eq 3 ]; then \
		echo ""; \
		echo "=================================================================="; \
		echo " make demo: CIFAR-10 is unavailable (see the message above)."; \
		echo " FALLING BACK TO data=synthetic -- these are NOT CIFAR-10 numbers."; \
		echo "=================================================================="; \
		echo ""; \
		$(BNEXP) train model=resnet20 norm=bn act=relu trainer.epochs=1 data=synthetic; \
	else exit $$rc; fi

clean:
	rm -rf $(VENV) build *.egg-info
