# The README's commands. Each target creates .venv and installs on first use; re-runs skip the install
# until pyproject.toml or the constraints change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt
PYTEST_ARGS ?=
# pytest-xdist workers for make test (one per core of a 2-core machine; each gets its share of torch's threads,
# tests/conftest.py); TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2
MUTATION_WORKERS ?= 2
# mutant name patterns for make mutation (empty: every module of the target), e.g. 'linvit.layers.families.*'
MUTANTS ?=

.PHONY: setup demo demo-cls demo-context demo-depth test lint bench gpu-check gpu-quality quality-grid gpu-prep triton-compat gpu-stack-test mutation clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) torch torchvision
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

# the main job: train a small linvit segmentation model on the built-in shapes task, evaluate it, write runs/seg_demo
# (a new make demo replaces it: --overwrite)
demo: $(STAMP)
	$(PY) train.py --config configs/seg_demo.yaml --overwrite
	@echo "demo run: runs/seg_demo (metrics.json, curves.png, model.safetensors; $(VENV)/bin/tensorboard --logdir runs/seg_demo)"
	@echo "pictures (image | ground truth | prediction): runs/seg_demo/pictures/"
	@echo "next (the tools live in $(VENV); or: source $(VENV)/bin/activate):"
	@echo "  $(PY) train.py --config configs/seg_folder.yaml data.root=/path/to/images_and_masks output_dir=runs/my_set"
	@echo "  make demo-cls"
	@$(PY) -c "$$DEMO_VERDICT" runs/seg_demo/metrics.json

# the demo's last line: its numbers and what they mean
define DEMO_VERDICT
import json, sys
m = json.load(open(sys.argv[1]))
iou = m['per_class_iou']
print(f"mIoU {m['miou']:.2f} (background {iou['background']:.2f}, red-key {iou['red-key']:.2f}, "
      f"blue-key {iou['blue-key']:.2f}): each grey shape's class is the colour of a key square elsewhere in its "
      f"image; a model blind to the key guesses red or blue per shape and scores about 0.5")
endef
export DEMO_VERDICT

# the classification demo's last line: its numbers and what they mean
define DEMO_CLS_VERDICT
import json, sys
m = json.load(open(sys.argv[1]))
print(f"top-1 {m['top1']:.2f} on {m['count']} validation images: the class is the pair of colours of two marks at "
      f"opposite sides of each image; chance is 0.25, and a model that sees only one mark, or counts colours, "
      f"scores at most 0.50")
endef
export DEMO_CLS_VERDICT

# the classification demo: a small linvit classifier on the built-in two-marks task, writes runs/cls_demo
demo-cls: $(STAMP)
	$(PY) train.py --config configs/cls_demo.yaml --overwrite
	@echo "demo run: runs/cls_demo (metrics.json, curves.png, pictures/, model.safetensors; $(VENV)/bin/tensorboard --logdir runs/cls_demo)"
	@echo "next (the tools live in $(VENV); or: source $(VENV)/bin/activate):"
	@echo "  $(PY) train.py --config configs/cls_folder.yaml data.root=/path/to/imagefolder output_dir=runs/my_set"
	@echo "  make bench"
	@$(PY) -c "$$DEMO_CLS_VERDICT" runs/cls_demo/metrics.json

# why whole-image inference matters: make demo's shapes task (a shape's class is a key's colour anywhere on the border),
# one model segmenting the validation images whole and in sliding windows of half the side; mIoU of each, pictures
demo-context: $(STAMP)
	$(PY) tools/context_demo.py --out runs/seg_context_demo

# the same for depth: configs/depth_demo.yaml (ground-plane scenes: a box is as far as the ground it stands on)
# trained into runs/depth_context_demo (384 steps, minutes on 2 cores); AbsRel, RMSE and delta1 of the validation
# scenes whole, in windows of half the side and as the training set's mean depth everywhere; pictures with the error
demo-depth: $(STAMP)
	$(PY) tools/context_demo.py --config configs/depth_demo.yaml --out runs/depth_context_demo

lint: $(STAMP)
	$(VENV)/bin/ruff check linvit tests tools train.py

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) tools/bench_attention.py

# the GPU check (docs/benchmarks.md: GPU check): kernel parity and speed, ViT-S/B speed against timm's softmax ViT and
# the floor, on the first CUDA device in at most 6 minutes -> runs/gpu_check/. It installs
# nothing: it runs .venv's python when there is one, else python3 (on a GPU machine: make gpu-check PY=python3).
FMNIST_DIR ?= /usr/share/datasets/fashion-mnist
GPU_CHECK_ARGS ?=
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) tools/gpu_check.py --device cuda:0 $(GPU_CHECK_ARGS)

# quality at high resolution (docs/benchmarks.md: GPU check): linvit against timm's softmax ViT trained by the engine
# (Tiny and Small at 512 px, equal steps; at 1024 px, equal seconds; a ViT-S teacher linearized at 1024 px) on
# Fashion-MNIST canvases rendered from the IDX files in FMNIST_DIR, in at most 5 minutes -> runs/quality_check/.
# Then the quality grid at 512 px (docs/benchmarks.md: Quality grid) -> runs/quality_grid/, with one seed: its 23
# runs (every configuration once) take ~6 minutes, ~11 in all. A GPU run is ~15 s, half of it the process's start
# (imports, CUDA, caches) and ~6 s of training (156 steps), so the 3-seed grid's 69 runs need ~17 minutes whatever
# the steps: fewer seeds, not fewer steps, is what fits one 10-minute command. For the 3 seeds run
# tools/quality_check.py --grid gpu --device cuda:0 alone. The grid exits 1 while a configuration errors (a row says
# why), so it goes last. Installs nothing; the same python as gpu-check.
GPU_QUALITY_ARGS ?=
GPU_GRID_ARGS ?= --seeds 1
gpu-quality:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) tools/quality_check.py --device cuda:0 \
		--fmnist-dir $(FMNIST_DIR) $(GPU_QUALITY_ARGS)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) tools/quality_check.py --grid gpu --device cuda:0 \
		--fmnist-dir $(FMNIST_DIR) $(GPU_GRID_ARGS)

# the quality grid on this CPU (docs/benchmarks.md: Quality grid): softmax and every linear configuration, local mix
# on and off, 3 seeds, classification and segmentation at 128 px with depth-4 models, 69 runs one after another in
# 82 minutes on 2 cores (measured; nala and polar runs are the slow ones) -> runs/quality_grid/ (quality_grid.md,
# .csv, .png)
quality-grid: $(STAMP)
	$(PY) tools/quality_check.py --grid cpu --device cpu --fmnist-dir $(FMNIST_DIR)

# what a GPU machine lacks, for the device's run to carry (git-ignored via .git/info/exclude): .whl/ holds the cp312
# wheels of the training stack the GPU image does not ship (versions from the constraints), .gpudata/ the
# Fashion-MNIST IDX files (Debian's dataset-fashion-mnist). docs/benchmarks.md (GPU check) has the command that uses
# them.
GPU_WHEELS := albumentations albucore simsimd stringzilla omegaconf pydantic pydantic_core annotated-types \
	typing-inspection typing_extensions timm
gpu-prep:
	grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
	grep -qx '/.gpudata/' .git/info/exclude || echo /.gpudata/ >> .git/info/exclude
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$(foreach w,$(GPU_WHEELS),$(shell grep -i '^$(subst _,[-_],$(w))==' $(CONSTRAINTS)))
	test -f .gpudata/fashion-mnist/train-images-idx3-ubyte.gz || ( mkdir -p .gpudata/deb && cd .gpudata/deb && \
		apt-get download dataset-fashion-mnist && dpkg -x dataset-fashion-mnist_*.deb root && \
		mkdir -p ../fashion-mnist && cp root/usr/share/datasets/fashion-mnist/* ../fashion-mnist/ ) && \
		rm -rf .gpudata/deb

# the GPU machine's Triton (3.6, with its torch 2.11: the device notes) compiles every kernel variant for sm_90 and
# sm_80, checked without a GPU: installs that Triton alone into build/ (a 188 MB wheel from PyPI, 642 MB installed,
# once) and runs the ahead-of-time compile test with it. Not part of make test; run it after changing
# linvit/ops/linear_attn/kernels.py.
GPU_TRITON ?= 3.6.0
GPU_TRITON_DIR := build/triton-$(GPU_TRITON)
triton-compat: $(STAMP)
	test -f $(GPU_TRITON_DIR)/triton/__init__.py || \
		$(PY) -m pip install --quiet --no-deps --target $(GPU_TRITON_DIR) triton==$(GPU_TRITON)
	PYTHONPATH=$(GPU_TRITON_DIR) $(PY) -c "import triton; v = triton.__version__; \
		assert v == '$(GPU_TRITON)', f'imported triton {v} from {triton.__file__}, expected $(GPU_TRITON)'; print('triton', v)"
	LINVIT_TRITON_COMPAT=full PYTHONPATH=$(GPU_TRITON_DIR) $(PY) -m pytest -q -p no:cacheprovider \
		tests/ops/test_triton_compile.py

# the whole suite on the GPU machine's stack (torch 2.11.0, its Triton 3.6.0, torchvision 0.26.0: the device notes),
# CPU only: a separate venv in build/ (torch's CUDA wheels, ~3 GB from PyPI, once), the other pins of the constraints,
# except NumPy 2.2 (Triton 3.6's interpreter takes int() of one-element arrays, which NumPy 2.4 rejects). Not part of
# make test; run it after changing code the GPU check uses (linvit/ops, linvit/layers, linvit/bench, tools/).
GPU_TORCH ?= 2.11.0
GPU_TORCHVISION ?= 0.26.0
GPU_NUMPY ?= 2.2.6
GPU_STACK_VENV := build/venv-torch-$(GPU_TORCH)
gpu-stack-test:
	test -f $(GPU_STACK_VENV)/.installed || ( rm -rf $(GPU_STACK_VENV) && $(PYTHON) -m venv $(GPU_STACK_VENV) && \
		grep -iv '^\(torch\|torchvision\|triton\|numpy\|nvidia-[a-z0-9-]*\|cuda-[a-z-]*\)==' $(CONSTRAINTS) > $(GPU_STACK_VENV)/constraints.txt && \
		$(GPU_STACK_VENV)/bin/python -m pip install --quiet -c $(GPU_STACK_VENV)/constraints.txt \
			torch==$(GPU_TORCH) torchvision==$(GPU_TORCHVISION) numpy==$(GPU_NUMPY) -e '.[dev]' && \
		touch $(GPU_STACK_VENV)/.installed )
	test $(GPU_STACK_VENV)/.installed -nt pyproject.toml || ( $(GPU_STACK_VENV)/bin/python -m pip install --quiet \
		--no-deps -e . && touch $(GPU_STACK_VENV)/.installed )
	$(GPU_STACK_VENV)/bin/python -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', \
		triton.__version__, 'numpy', numpy.__version__)"
	$(GPU_STACK_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider tests $(PYTEST_ARGS)

# mutation testing, not part of make test: mutmut mutates linvit/ops, linvit/layers and linvit/models one change at
# a time and runs the tests that cover each change (.ci/mutation/setup.cfg), in a fresh copy of the tracked tree under
# build/mutation. Its runner takes hours on 2 cores; README (Tests) shows how .ci/mutation/run_unchecked.py finishes
# the slow rest. Survivors: cd build/mutation && ../../.venv/bin/mutmut results; the ones accepted as equivalent are
# listed, with reasons, in .ci/mutation/equivalent_mutants.md.
MUTATION_DIR := build/mutation
mutation: $(STAMP)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) mutmut
	rm -rf $(MUTATION_DIR) && mkdir -p $(MUTATION_DIR)
	git ls-files -z | tar --null -T - -cf - | tar -xf - -C $(MUTATION_DIR)
	cp .ci/mutation/setup.cfg $(MUTATION_DIR)/setup.cfg
	cd $(MUTATION_DIR) && ../../$(VENV)/bin/mutmut run --max-children $(MUTATION_WORKERS) $(MUTANTS)
	$(PY) .ci/mutation/score.py $(MUTATION_DIR)/mutants .ci/mutation/equivalent_mutants.md $(MUTANTS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
