"""The GPU check: the linear-attention kernel's parity and speed, and whole-model speed, in one short run
(``tools/gpu_check.py``, ``make gpu-check``).

    settings = CheckSettings(device='cuda:0').resolved()      # or CheckSettings(device='cpu', quick=True)
    status = run_check(settings, start=time.time())         # writes settings.out/gpu_check.{md,csv} and the plot

Three sections, each in its own process under a hard time budget; whatever does not fit in its budget is written as
'skipped (time budget)', never estimated (quality, linvit against softmax ViTs trained through the engine, is the
check of its own ``linvit.bench.quality``, ``make gpu-quality``):

1. parity: the Triton kernel against float64 ``linvit.ops.linear_attention``, output and gradients, in float32,
   bfloat16 and float16, at 1k, 16k and 64k tokens;
2. op: the op's forward and forward+backward (bfloat16, 1k to 32k tokens) against torch's SDPA and the op's
   PyTorch path;
3. models: ViT-S and ViT-B at 512, 1024 and 2048 px, linvit, its floor and timm's softmax ViT: compiled training
   steps (img/s, peak memory) and CUDA-graph inference (img/s); last, linvit on the PyTorch path. Compilation is
   most of this section's time: a compile cache (``cache_dir``) makes a rerun on the same machine reach further.

The modules:

    plan      settings, presets (FULL on a GPU, QUICK on a CPU), the planned rows of each section
    sections  a section's process (``python -m linvit.bench.gpu_check.sections SETTINGS_JSON SECTION``): measures
              its rows, prints one result line per row
    runner    the parent: the sections' processes under their deadlines, their records, ``run_check``
    report    gpu_check.md (the tables, also printed), gpu_check.csv (one row per measurement),
              gpu_check_throughput.png (img/s against image size)

Output in ``out``: those three files and logs/<section>.log. ``run_check`` returns 1 when a parity row FAILs or a
measurement errors, else 0.
"""
from .plan import COMPILE_BACKENDS, FULL, QUICK, SECTIONS, CheckSettings
from .runner import run_check

__all__ = ['COMPILE_BACKENDS', 'FULL', 'QUICK', 'SECTIONS', 'CheckSettings', 'run_check']
