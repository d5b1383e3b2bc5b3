#!/usr/bin/env python
"""Whole models at growing image sizes: linvit vs timm softmax ViTs vs their floors, eager vs compiled.

For every configuration (model, image size, batch, precision, eager|compiled, inference|training) a fresh Python
process builds the model with ``timm.create_model(name, img_size=(H, W), pretrained=False)``, runs warm-up calls (the
first one compiles, its time is reported apart), then times ``--repeats`` calls: median and p90 latency (ms),
images/s, and memory in MiB. Memory: ``base`` is what the process holds right after building the model and its
inputs, ``peak`` the most it held during the timed calls (after warm-up: the step's own peak, not the build's or the
compiler's), ``added`` that peak above ``base`` (what the forward or training step costs, with whatever the warm-up
left allocated: gradients, compiled code). On CPU these are the process's resident set size (RSS), so ``base`` and
``peak`` include the interpreter, torch and, when compiled, the compiler; on CUDA they are the tensors torch
allocated (``torch.cuda.memory_allocated``). The floor of a model is the same model with token mixing removed
(``--floors all|linear|none``): what any attention must pay at least. Compiled runs go through ``linvit.fast``
(static shapes: each configuration compiles its own graph in its own process).
A configuration that runs out of memory or time is recorded as such and the sweep goes on; one that fails with an
error (an unknown model, a size the model rejects) is recorded with the child's exception message, listed at the
end, and makes the exit status 1. ``--rounds R`` runs the sweep R times (round after round) and reports each
configuration's median over rounds: processes differ (memory placement, the machine's other load), so one process
per configuration needs rounds to give steady ratios.
``--retain-freed-memory`` runs every configuration with glibc keeping freed memory: by default it hands large freed
buffers back to the system and faults fresh pages in when the next call allocates them again, a per-process cost
that moves CPU figures by 10-20% (the ``allocator`` column records the setting).

Rows go to ``OUT/profile.csv`` as they complete; then, per (workload, precision, batch, mode), a table per linvit
model (its floor and its softmax counterpart side by side: img/s, ratios linvit/floor and linvit/softmax, added
memory), the crossover size from which linvit beats softmax, the time growth per doubling of the image side, and
compiled/eager ratios; ``OUT/profile_<workload>_<dtype>_b<batch>.png`` plots img/s and added memory against the
image size (log-log, floors dashed). ``--summarize CSV`` re-reads a run and writes its PNGs next to the CSV.

    python tools/profile_resolution.py                                    # ViT-S/16: linvit vs vit, 224..2048 px
    python tools/profile_resolution.py --models linvit_small_patch16_224:local_mix=False vit_small_patch16_224 \\
        --sizes 224 512 1024 2048 --mode eager compiled --repeats 3 --out /tmp/prof
    python tools/profile_resolution.py --sizes 384x640 768x1280 --dtype bfloat16 --workload inference training \\
        --batch 1 8
    python tools/profile_resolution.py --device cuda --compile-mode reduce-overhead --batch 1 16 --dtype bfloat16
    python tools/profile_resolution.py --summarize /tmp/prof/profile.csv   # tables and plots of an earlier run

Model specs are ``name`` or ``name:key=value,key=value`` (values as Python literals, e.g. ``local_mix=False``,
``attn_family='performer'``, ``feature_map='relu'``, ``softmax_blocks=(0,6)``, ``depth=2``). Precision: inference
casts model and input to the dtype; training keeps float32 weights and runs forward and loss under autocast
(forward, loss, backward timed). The library is ``linvit.bench.profile`` (sweep), ``linvit.bench.report`` (tables)
and ``linvit.bench.plots`` (figures).
"""
import argparse
import sys
from typing import List, Optional

from linvit.bench import profile_cli


def build_parser() -> argparse.ArgumentParser:
    """The options (shared with profile_forward.py's pass-through, hence defined in linvit.bench.profile_cli)."""
    return profile_cli.build_parser(description=__doc__)


def main(argv: Optional[List[str]] = None) -> int:
    return profile_cli.main(argv, description=__doc__)


if __name__ == '__main__':
    sys.exit(main())
