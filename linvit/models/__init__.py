"""The timm models ``linvit_*`` and conversion of timm softmax ViTs to linear attention.

Importing this package registers the models with timm (``timm.list_models('linvit_*')``), each also with the tag
``.pyramid`` whose ``features_only`` model is the simple feature pyramid (``PyramidFeatureNet``).
"""
from .bounded import (
    bounded_forward_features,
    bounded_forward_intermediates,
    bounded_segment,
    bounded_segment_unsupported_reason,
    bounded_unsupported_reason,
    iter_bounded_segment,
)
from .context import ContextParallel, RowShards
from .convert import convert_to_linear, linear_attention_from_softmax
from .feature_net import PYRAMID_TAG, PyramidFeatureNet
from .linvit import (
    BLOCK_TYPES,
    LinearAttentionBlock,
    LinearVisionTransformer,
    SoftmaxAttentionBlock,
    block_types,
    checkpoint_filter_fn,
    resolve_softmax_blocks,
)
from .segmentation import SEG_HEADS, MLPHead, SegmentationModel, SimpleFeaturePyramid

__all__ = ['LinearVisionTransformer', 'LinearAttentionBlock', 'SoftmaxAttentionBlock', 'BLOCK_TYPES',
           'block_types', 'resolve_softmax_blocks', 'checkpoint_filter_fn', 'convert_to_linear',
           'linear_attention_from_softmax', 'SegmentationModel', 'SimpleFeaturePyramid', 'MLPHead', 'SEG_HEADS',
           'bounded_forward_features', 'bounded_forward_intermediates', 'bounded_unsupported_reason',
           'iter_bounded_segment', 'bounded_segment', 'bounded_segment_unsupported_reason', 'ContextParallel',
           'RowShards', 'PyramidFeatureNet', 'PYRAMID_TAG']
