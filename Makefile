# The README's commands. Each target creates .venv and installs on first use; re-runs skip the install
# until pyproject.toml or the constraints change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt
PYTEST_ARGS ?=

.PHONY: setup demo demo-cls test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) torch torchvision
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

# the main job: train a small linvit segmentation model on the built-in shapes task, evaluate it, write runs/demo_seg
demo: $(STAMP)
	$(PY) train.py --config configs/seg_demo.yaml
	@echo "demo run: runs/demo_seg (metrics.json, curves.png, model.safetensors; tensorboard --logdir runs/demo_seg)"
	@echo "pictures (image | ground truth | prediction): runs/demo_seg/pictures/"
	@echo "next: python train.py --config configs/seg_folder.yaml data.root=/path/to/images_and_masks; make demo-cls"

# the classification demo: a small linvit classifier on the built-in two-marks task, writes runs/demo
demo-cls: $(STAMP)
	$(PY) train.py --config configs/cls_demo.yaml
	@echo "demo run: runs/demo (metrics.json, curves.png, pictures/, model.safetensors; tensorboard --logdir runs/demo)"
	@echo "next: python train.py --config configs/cls_folder.yaml data.root=/path/to/imagefolder; make bench"

lint: $(STAMP)
	$(VENV)/bin/ruff check linvit tests tools train.py

test: $(STAMP) lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) tools/bench_attention.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
