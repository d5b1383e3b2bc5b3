"""Forward time and peak memory of linvit vs timm's softmax ViT at one image size, each model in its own process.

    .venv/bin/python tools/profile_forward.py --size 1024 --repeats 5

Configurations (batch 1, float32, torch.no_grad, eager, dynamic image size):
    linvit  linvit_small_patch16_512 (linear attention + local mixing), run at --size
    linvit_nolocal  the same with local_mix=False (linear attention only)
    softmax timm vit_small_patch16_224 with dynamic_img_size=True, run at --size
    floor   the same timm ViT with token mixing removed (attention returns proj(v)): the cost of everything else
Each runs in a fresh subprocess (so peak RSS is its own); the time is the median of --repeats forwards after
--warmup forwards. Absolute numbers depend on the machine; compare the ratios.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict

import timm
import torch
from timm.layers import Attention

import linvit  # noqa: F401  (registers the linvit_* models)


class FloorAttention(Attention):
    """timm Attention without token mixing: proj(v). Same projections, so it costs everything but the mixing."""

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        v = self.qkv(x).reshape(B, N, 3, self.attn_dim)[:, :, 2]
        return self.proj_drop(self.proj(self.norm(v)))


CONFIGS: Dict[str, Callable[[], torch.nn.Module]] = {
    'linvit': lambda: timm.create_model('linvit_small_patch16_512'),
    'linvit_nolocal': lambda: timm.create_model('linvit_small_patch16_512', local_mix=False),
    'softmax': lambda: timm.create_model('vit_small_patch16_224', dynamic_img_size=True),
    'floor': lambda: timm.create_model('vit_small_patch16_224', dynamic_img_size=True, attn_layer=FloorAttention),
}


def _rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(config: str, size: int, warmup: int, repeats: int) -> Dict[str, object]:
    """Build one configuration and time its forward on a [1, 3, size, size] image."""
    torch.manual_seed(0)
    model = CONFIGS[config]().eval()
    x = torch.randn(1, 3, size, size)
    rss_built = _rss_mib()
    times = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            start = time.perf_counter()
            out = model(x)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    assert torch.isfinite(out).all()
    return {'config': config, 'size': size, 'threads': torch.get_num_threads(), 'median_s': statistics.median(times),
            'times_s': times, 'rss_after_build_mib': rss_built, 'peak_rss_mib': _rss_mib()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--size', type=int, default=1024)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--configs', nargs='+', default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument('--child', choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.size, args.warmup, args.repeats)))
        return

    results = {}
    for config in args.configs:
        cmd = [sys.executable, __file__, '--child', config, '--size', str(args.size),
               '--warmup', str(args.warmup), '--repeats', str(args.repeats)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[config] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'config':14s} {'size':>5s} {'median s':>9s} {'peak RSS MiB':>13s} {'RSS after build':>16s}  runs (s)")
    for config, r in results.items():
        runs = ' '.join(f'{t:.3f}' for t in r['times_s'])
        print(f"{config:14s} {r['size']:5d} {r['median_s']:9.3f} {r['peak_rss_mib']:13.0f} "
              f"{r['rss_after_build_mib']:16.0f}  {runs}")
    for a, b in (('linvit', 'softmax'), ('linvit', 'floor'), ('linvit_nolocal', 'floor'), ('softmax', 'floor')):
        if a in results and b in results:
            print(f"{a}/{b}: time x{results[a]['median_s'] / results[b]['median_s']:.2f}, "
                  f"peak RSS x{results[a]['peak_rss_mib'] / results[b]['peak_rss_mib']:.2f}")


if __name__ == '__main__':
    main()
