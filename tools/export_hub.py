#!/usr/bin/env python
"""Publish a trained run as a timm / Hugging Face model folder, and optionally upload it to the Hub.

    python tools/export_hub.py runs/cls_demo                         # -> runs/cls_demo/hub/
    python tools/export_hub.py runs/cls_demo --out linvit-demo/      # another folder
    python tools/export_hub.py runs/cls_demo --push me/linvit-demo --private   # and upload it (needs a token)

The folder holds config.json (timm's layout: architecture, model_args, pretrained_cfg with the run's normalisation
and class names), model.safetensors (the run's evaluated weights) and README.md (a model card with the run's metrics
and config; set its license before publishing). It is checked before it is written: timm.create_model('local-dir:
FOLDER', pretrained=True), after `import linvit`, must give the run's outputs. Classification runs and
linearizations of classifiers export; segmentation runs are refused (their model is not a timm model: export ONNX).
--push uploads the folder with huggingface_hub (the repository is created when missing); it needs a token from
`hf auth login` (`huggingface-cli login`) or HF_TOKEN.

Exit status: 0 written (and pushed); 2 the run cannot be exported (not a run, not a timm classifier, a folder
holding other files); 1 the upload failed (the folder stays written). Each failure is one line on stderr.
The library: linvit.engine.hub.
"""
import argparse
import sys
from typing import List, Optional

from linvit.bench.cli import HelpFormatter
from linvit.engine.hub import HubExportError, HubPushError, export_hub_folder, push_hub_folder

EXIT_EXPORT, EXIT_PUSH = 2, 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('run', help='a run directory of train.py')
    parser.add_argument('--out', help='the folder to write (default: hub/ in the run directory); it must be new, '
                                      'empty or an earlier export')
    parser.add_argument('--push', metavar='REPO_ID', help='upload the folder to this Hugging Face model repository '
                                                          '(user/name)')
    parser.add_argument('--private', action='store_true', help='with --push: create the repository private')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.private and not args.push:
        build_parser().error('--private goes with --push REPO_ID')
    try:
        export = export_hub_folder(args.run, args.out, repo_id=args.push)
    except (HubExportError, FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_EXPORT
    print(f"wrote {export.folder} (config.json, model.safetensors, README.md): {export.architecture}, "
          f"{len(export.class_names)} classes; timm.create_model({export.model_name!r}, pretrained=True) after "
          f"`import linvit` gives the run's outputs (max abs difference {export.max_abs_difference:.3g})")
    if not args.push:
        return 0
    try:
        url = push_hub_folder(export.folder, args.push, private=args.private)
    except HubPushError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_PUSH
    print(f"pushed to {args.push}: {url} (load it with timm.create_model('hf-hub:{args.push}', pretrained=True))")
    return 0


if __name__ == '__main__':
    sys.exit(main())
