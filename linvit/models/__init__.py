"""timm model family ``linvit_*`` and conversion of timm softmax ViTs to linear attention.

Importing this package registers the models with timm (``timm.list_models('linvit_*')``).
"""
from .convert import convert_to_linear, linear_attention_from_softmax
from .linvit import (
    ATTENTION_KINDS,
    LinearAttentionBlock,
    LinearVisionTransformer,
    SoftmaxAttentionBlock,
    attention_kinds,
    checkpoint_filter_fn,
    resolve_softmax_blocks,
)
from .segmentation import SEG_HEADS, MLPHead, SegmentationModel, SimpleFeaturePyramid

__all__ = ['LinearVisionTransformer', 'LinearAttentionBlock', 'SoftmaxAttentionBlock', 'ATTENTION_KINDS',
           'attention_kinds', 'resolve_softmax_blocks', 'checkpoint_filter_fn', 'convert_to_linear',
           'linear_attention_from_softmax', 'SegmentationModel', 'SimpleFeaturePyramid', 'MLPHead', 'SEG_HEADS']
