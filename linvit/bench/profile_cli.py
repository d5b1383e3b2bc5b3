"""The command line of a profile sweep, shared by ``tools/profile_resolution.py`` (every option) and
``tools/profile_forward.py`` (a preset at one size whose other options pass through to this parser).

    status = main(['--models', 'linvit_small_patch16_224', '--sizes', '512', '1024'], description=__doc__)
"""
import argparse
import os
import tempfile
from typing import List, Optional

from linvit.models.bounded import DEFAULT_ROWS_PER_CHUNK
from linvit.precision import PRECISIONS

from . import profile, report
from .cli import THREADS_HELP, HelpFormatter, measurement_threads, precision_arg, threads_arg
from .specs import MODES, PROFILE_MODES, PROFILE_WORKLOADS, parse_model_spec, parse_size

__all__ = ['DEFAULT_MODELS', 'DEFAULT_SIZES', 'DEFAULT_OUT', 'build_parser', 'parse_args', 'build_configs', 'main']

DEFAULT_MODELS = ['linvit_small_patch16_224', 'vit_small_patch16_224']
DEFAULT_SIZES = ['224', '512', '1024', '2048']
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), 'linvit_profile_resolution')


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument('--models', nargs='+', default=DEFAULT_MODELS, metavar='SPEC',
                        help='timm model specs, name[:key=value,...]')
    parser.add_argument('--floors', choices=profile.FLOORS, default='all',
                        help='also profile the floor of every model (all), of the linvit models only, or none')
    parser.add_argument('--sizes', nargs='+', type=parse_size, metavar='SIZE',
                        help=f'image sizes, N or HxW (default: {" ".join(DEFAULT_SIZES)})')
    parser.add_argument('--batch', nargs='+', type=int, default=[1], help='batch sizes')
    parser.add_argument('--dtype', nargs='+', type=precision_arg, choices=list(PRECISIONS), default=['float32'],
                        help='precisions: inference casts model and input, training runs under autocast')
    parser.add_argument('--mode', nargs='+', choices=PROFILE_MODES, default=list(MODES),
                        help='eager PyTorch, compiled through linvit.fast (torch.compile, static shapes), or bounded: '
                             'the whole image in bands of --rows-per-chunk patch rows (linvit.models.bounded; '
                             'inference of linvit models, the others are left out)')
    parser.add_argument('--workload', nargs='+', choices=PROFILE_WORKLOADS, default=['inference'],
                        help='inference: a forward under inference_mode; training: forward, loss and backward; '
                             'segmentation: the backbone in a SegmentationModel (simple pyramid, MLP head), class '
                             'ids at full resolution; detection: the backbone and its pyramid under Faster R-CNN, '
                             'boxes out (eager only: the detector picks boxes with data-dependent shapes)')
    parser.add_argument('--rows-per-chunk', type=int, default=DEFAULT_ROWS_PER_CHUNK,
                        help='bounded: patch rows per band (the memory budget)')
    parser.add_argument('--warmup', type=int, default=2, help='untimed calls before timing, >= 1 (the first compiles)')
    parser.add_argument('--repeats', type=int, default=5, help='timed calls per configuration')
    parser.add_argument('--compile-mode', help="torch.compile mode of compiled runs, e.g. 'reduce-overhead' (CUDA "
                        "graphs) or 'max-autotune' (default: torch's default)")
    parser.add_argument('--rounds', type=int, default=1,
                        help='run the whole sweep this many times (fresh processes each time) and report, per '
                             'configuration, the median over rounds: steadier ratios on a noisy machine')
    parser.add_argument('--device', default='cpu', help="torch device to run on, e.g. 'cpu', 'cuda', 'cuda:1'")
    parser.add_argument('--threads', type=threads_arg, default='auto',
                        help=f"{THREADS_HELP}. Read once before the sweep: every configuration's process uses the "
                             f"same number")
    parser.add_argument('--retain-freed-memory', action='store_true',
                        help='run each configuration with glibc keeping freed memory (MALLOC_MMAP_THRESHOLD_ and '
                             'MALLOC_TRIM_THRESHOLD_ = 2**34), as jemalloc/tcmalloc would: no page faults for '
                             'buffers re-allocated every call. Compiled models and training steps on CPU keep it '
                             'anyway (linvit.fast.allocator); this adds eager inference (default: the system '
                             'allocator settings)')
    parser.add_argument('--timeout', type=float, default=1800.,
                        help="seconds one configuration may take (its process: build, warm-up and timed calls) "
                             "before it is stopped and recorded as 'timeout'")
    parser.add_argument('--out', help=f'directory for profile.csv and the PNGs (default: {DEFAULT_OUT}; with '
                                      f'--summarize: the folder of the CSV)')
    parser.add_argument('--summarize', metavar='CSV',
                        help="print the tables of an earlier run's CSV and plot it, run nothing")
    return parser


def parse_args(argv: Optional[List[str]] = None, description: Optional[str] = None) -> argparse.Namespace:
    """Parse and check; fills the default sizes and output folder, and ``measurement``: the threads every
    configuration uses and the CPU load now (``cli.measurement_threads``)."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error('--warmup, --repeats and --rounds must be >= 1')
    if min(args.batch) < 1:
        parser.error('--batch sizes must be >= 1')
    if args.rows_per_chunk < 1:
        parser.error('--rows-per-chunk must be >= 1')
    try:
        for text in args.models:
            parse_model_spec(text)
    except ValueError as exc:
        parser.error(str(exc))
    args.sizes = args.sizes or [parse_size(s) for s in DEFAULT_SIZES]
    args.out = args.out or (os.path.dirname(os.path.abspath(args.summarize)) if args.summarize else DEFAULT_OUT)
    args.measurement = measurement_threads(args.threads, args.device)
    return args


def build_configs(args: argparse.Namespace) -> List[profile.Config]:
    """The sweep's configurations from parsed options (``profile.build_configs``)."""
    return profile.build_configs(args.models, args.sizes, args.floors, args.workload, args.dtype, args.batch,
                                 args.mode, args.device, args.warmup, args.repeats, args.measurement.threads,
                                 args.compile_mode, args.rows_per_chunk)


def main(argv: Optional[List[str]] = None, description: Optional[str] = None) -> int:
    """Run the sweep (or re-read one with --summarize) and print its report; 0 when every configuration ran (or ran
    out of memory or time), 1 when any failed with an error."""
    args = parse_args(argv, description)
    os.makedirs(args.out, exist_ok=True)
    if args.summarize:
        profile.print_report(report.read_csv(args.summarize), args.out)
        return 0
    for line in args.measurement.warning_lines(prefix=''):
        print(line, flush=True)  # now, before the sweep's minutes; the tables repeat it
    csv_path = os.path.join(args.out, 'profile.csv')
    rows = profile.sweep(build_configs(args), csv_path, args.rounds, args.timeout, args.retain_freed_memory,
                         args.measurement.load)
    print(f"wrote {csv_path}")
    profile.print_report(rows, args.out)
    return profile.exit_status(rows)
