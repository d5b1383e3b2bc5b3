"""What to measure, written as text on a command line: model specs ``name:key=value,...`` and image sizes ``N`` or
``HxW``."""
import argparse
import ast
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

__all__ = ['MODES', 'WORKLOADS', 'PROFILE_MODES', 'PROFILE_WORKLOADS', 'ModelSpec', 'parse_model_spec', 'parse_size',
           'size_label', 'counterpart',
           'SIZE_WORDS']

#: how a model runs: eager PyTorch, or compiled through linvit.fast
MODES = ('eager', 'compiled')
#: what is timed: a training step (forward, loss, backward), or a forward under inference_mode; the GPU check measures
#: them in this order
WORKLOADS = ('training', 'inference')
#: the resolution profiler's modes: MODES, and the bounded forward (``linvit.models.bounded``: the whole image in
#: bands of patch rows, memory bounded; inference of linvit models)
PROFILE_MODES = MODES + ('bounded',)
#: the resolution profiler's workloads: WORKLOADS, segmentation (a ``SegmentationModel`` on the backbone, class
#: ids at full resolution, as tools/predict.py makes them) and detection (the backbone and its pyramid under
#: torchvision's Faster R-CNN, boxes out; eager only)
PROFILE_WORKLOADS = WORKLOADS + ('segmentation', 'detection')

#: timm's model size words, used to pair a linvit model with the softmax model of the same size
SIZE_WORDS = ('tiny', 'small', 'base', 'large', 'huge', 'giant')


@dataclass(frozen=True)
class ModelSpec:
    """A model to measure: timm name + create_model kwargs, or the floor of such a model (token mixing removed)."""
    spec: str
    name: str
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    floor: bool = False

    @property
    def label(self) -> str:
        return f"floor({self.spec})" if self.floor else self.spec

    @property
    def kind(self) -> str:
        """'linvit' (linvit_*, hybrids included), 'softmax' (any other timm ViT) or 'floor': the one set of model
        kinds every bench table uses (the GPU check adds 'linvit_torch')."""
        if self.floor:
            return 'floor'
        return 'linvit' if self.name.startswith('linvit_') else 'softmax'

    def as_floor(self) -> 'ModelSpec':
        return ModelSpec(self.spec, self.name, self.kwargs, floor=True)


def parse_model_spec(text: str) -> ModelSpec:
    """'name' or 'name:key=value,...' -> ModelSpec; values are Python literals, anything else a string
    (``linvit_small_patch16_224:attn_family='performer',softmax_blocks=(0,6)``)."""
    name, _, rest = text.partition(':')
    if not name:
        raise ValueError(f"model spec {text!r} has no model name")
    kwargs = []
    for item in filter(None, (part.strip() for part in _split_top_level(rest))):
        key, eq, value = item.partition('=')
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"model spec {text!r}: expected key=value, got {item!r}")
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed = value.strip()
        kwargs.append((key.strip(), parsed))
    return ModelSpec(text, name, tuple(kwargs))


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets: 'a=1,b=(0,6)' -> ['a=1', 'b=(0,6)']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in '([{'
        depth -= ch in ')]}'
        if ch == ',' and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_size(text: str) -> Tuple[int, int]:
    """'224' -> (224, 224); '384x640' -> (384, 640) as (height, width). Raises argparse.ArgumentTypeError (a
    ValueError) otherwise, so that it serves as an argparse ``type``."""
    parts = text.lower().split('x')
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"image size must be N or HxW with positive integers, got {text!r}")
    return values[0], values[1]


def size_label(height: int, width: int) -> str:
    """'224' for a square, '384x640' otherwise: how sizes are written on the command line."""
    return str(height) if height == width else f"{height}x{width}"


def counterpart(linear_name: str, softmax_names: Sequence[str]) -> Optional[str]:
    """The softmax model to compare a linvit model with: vit_<rest> for linvit_<rest>, else the one of the same
    size word and patch (e.g. 'small', 'patch16'), else the only one; None if ambiguous or absent."""
    if not softmax_names:
        return None
    rest = linear_name[len('linvit_'):] if linear_name.startswith('linvit_') else linear_name
    for name in softmax_names:
        if name == f"vit_{rest}":
            return name
    tokens = set(rest.split('_'))
    keys = {t for t in tokens if t in SIZE_WORDS or t.startswith('patch')}
    matches = [n for n in softmax_names if keys and keys <= set(n.split('_'))]
    if len(matches) == 1:
        return matches[0]
    return softmax_names[0] if len(set(softmax_names)) == 1 else None
