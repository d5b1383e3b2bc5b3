"""Every attention family linvit offers, as drop-ins for ``timm.layers.Attention``, and the one registry that names
them (``ATTENTION_FAMILIES``; ``list_attention_kinds()`` adds the feature maps of plain linear attention).

Each family subclasses ``LinearAttention`` and replaces only its token mixing (``mix``): the qkv projection, the
optional q/k norms, local mixing, output norm and gate and the output projection stay timm's, with timm's parameter
names, so a softmax checkpoint loads into any of them (the family's own tensors keep their initial values).

    layer = attention_layer('performer', num_features=128)(dim=384, num_heads=6)
    model = timm.create_model('linvit_small_patch16_224', attn_kernel='linformer', attn_options={'low_rank_size': 8})

| name | mixing | cost per block | own tensors |
|---|---|---|---|
| linear (a feature map: elu1, relu, focused) | phi(q)(phi(k)^T v) / normaliser | O(N d^2) | none |
| performer | FAVOR+ random features ~ softmax | O(N m d) | buffer ``projection`` [m, d] |
| linformer | softmax over keys/values pooled to r x r | O(N r^2 d) | none |
| gated | linear attention, keys gated per token and channel, output gated | O(N d^2) | ``key_gate``, ``gate`` |
| aft | sigmoid(q) * sum_n softmax_n(k) v_n (AFT-simple) | O(N C) | none |
| bidirectional | linear attention weighted by decay^distance, forward + backward scans | O(N d^2) | ``scan_gate`` |
"""
from typing import Any, Dict, List, Optional, Tuple, Type

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import FEATURE_MAPS, list_feature_maps
from ..ops.causal import SCAN_ORDERS, bidirectional_linear_attention_op, grid_scan_orders, retention_decays
from ..ops.families import (
    aft_simple,
    gated_linear_attention_from_features,
    gaussian_projection,
    low_rank_attention,
    performer_attention,
)
from .linear_attention import _LINEAR_ONLY_OPTIONS, LinearAttention, configured_layer, to_compute_dtype
from .local_mix import resolve_token_grid

__all__ = ['PerformerAttention', 'LowRankAttention', 'GatedLinearAttention', 'AFTAttention', 'BidirectionalAttention',
           'ATTENTION_FAMILIES',
           'FAMILY_OPTIONS', 'attention_layer', 'list_attention_kinds', 'resolve_attention_kind',
           'redraw_random_features', 'FAMILIES_WITH_FEATURE_MAP']


def check_no_key_mask(key_mask: Optional[torch.Tensor], family: str, reason: str) -> None:
    """ValueError for a key mask where ``family`` cannot apply one (an fx leaf: under tracing the mask is a graph
    value, checked when the graph runs)."""
    if key_mask is not None:
        raise ValueError(family + " attention " + reason + " and cannot apply a key mask")


def check_token_key_mask(key_mask: Optional[torch.Tensor]) -> None:
    """ValueError for a per-head key mask [B, H, N], which AFT cannot apply (an fx leaf, as ``check_no_key_mask``)."""
    if key_mask is not None and key_mask.dim() == 3:
        raise ValueError("aft attention takes a key mask per token [B, N], not per head")


# leaves for torch.fx: the ops branch on shapes and masks; every one of them also compiles with TorchScript, which
# timm's model tests run on the traced graph
torch.fx.wrap('performer_attention')
torch.fx.wrap('low_rank_attention')
torch.fx.wrap('gated_linear_attention_from_features')
torch.fx.wrap('aft_simple')
torch.fx.wrap('bidirectional_linear_attention_op')
torch.fx.wrap('grid_scan_orders')
torch.fx.wrap('resolve_token_grid')
torch.fx.wrap('check_no_key_mask')
torch.fx.wrap('check_token_key_mask')
torch.fx.wrap('to_compute_dtype')


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[B, N, H, D] -> [B, H, N, D] (a view)."""
    return t.transpose(1, 2)


def _split_heads(qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, N, 3, H, D] -> q, k, v, each [B, H, N, D] (views; the layer applies its q/k norms)."""
    q, k, v = qkv.unbind(2)
    return _heads_first(q), _heads_first(k), _heads_first(v)


def _token_layout(kwargs: Dict[str, Any]) -> Tuple[int, Optional[Tuple[int, int]]]:
    """(num_prefix_tokens, grid_size) from a family's constructor options, for the layers that read the patch grid
    (linvit models set both after construction)."""
    grid = kwargs.get('grid_size')
    return kwargs.get('num_prefix_tokens', 1), None if grid is None else (int(grid[0]), int(grid[1]))


def _tokens_last(out: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] -> [B, N, H * D]."""
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


class PerformerAttention(LinearAttention):
    """Performer FAVOR+ (Choromanski et al. 2021): softmax attention approximated by positive orthogonal random
    features. ``projection`` [num_features, head_dim] is a buffer (saved in the state_dict, shared by the heads),
    drawn at construction from torch's RNG and redrawn only by ``redraw`` / ``linvit.redraw_random_features``,
    never in forward (so compile, export and resumed runs see the same features).

    num_features: m, random features per head (default: head_dim). orthogonal: orthogonal blocks (else i.i.d.).
    """

    supports_causal = False

    def __init__(self, dim: int, num_features: Optional[int] = None, orthogonal: bool = True, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        self.num_features = num_features or self.head_dim
        self.orthogonal = orthogonal
        self.fused_backward = False
        device = self.qkv.weight.device
        self.register_buffer('projection', gaussian_projection(self.num_features, self.head_dim, orthogonal,
                                                               device=device))

    @torch.no_grad()
    def redraw(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new projection (on the buffer's device), from ``generator`` or torch's default CPU RNG."""
        fresh = gaussian_projection(self.num_features, self.head_dim, self.orthogonal, generator=generator)
        if self.projection.device.type == 'meta':
            self.projection = fresh
        else:
            self.projection.copy_(fresh)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, family='performer', "
                f"num_features={self.num_features}, orthogonal={self.orthogonal}, eps={self.eps}")

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        q, k, v = _split_heads(qkv)
        return _tokens_last(performer_attention(self.q_norm(q), self.k_norm(k), v, self.projection, self.eps,
                                                key_mask))


class LowRankAttention(LinearAttention):
    """Linformer-style low-rank attention made resolution-agnostic: keys and values are average-pooled on the 2D
    patch grid to ``low_rank_size`` x ``low_rank_size`` tokens (prefix tokens kept), then every query attends to
    them with exact softmax. One set of weights runs at any image size. Needs the patch grid (``feat_size`` from
    linvit models, else ``grid_size`` / a square token count, as ``LocalMix``). Key-padding masks are refused:
    padded tokens would be pooled with real ones.
    """

    supports_causal = False

    def __init__(self, dim: int, low_rank_size: int = 16, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        if low_rank_size < 1:
            raise ValueError(f"low_rank_size must be >= 1, got {low_rank_size}")
        self.low_rank_size = low_rank_size
        self.grid_size: Optional[Tuple[int, int]]
        self.num_prefix_tokens, self.grid_size = _token_layout(kwargs)
        self.fused_backward = False

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, family='linformer', "
                f"low_rank_size={self.low_rank_size}")

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        check_no_key_mask(key_mask, 'linformer', 'pools keys over the patch grid')
        grid = resolve_token_grid(qkv.shape[1], self.num_prefix_tokens, self.grid_size, feat_size)
        q, k, v = _split_heads(qkv)
        return _tokens_last(low_rank_attention(self.q_norm(q), self.k_norm(k), v, grid, self.num_prefix_tokens,
                                               self.low_rank_size))


class GatedLinearAttention(LinearAttention):
    """Non-causal gated linear attention: a data-dependent gate per token and channel on the keys,
    sigmoid(key_gate(x)), and timm's output gate (``gated=True``: out * sigmoid(gate(x))), around linear attention
    with ``feature_map``. With a constant key gate it is plain linear attention (the constant cancels)."""

    supports_causal = False

    def __init__(self, dim: int, **kwargs) -> None:
        kwargs['gated'] = True
        super().__init__(dim, **kwargs)
        self.key_gate = nn.Linear(dim, self.attn_dim, device=self.qkv.weight.device, dtype=self.qkv.weight.dtype)
        self.fused_backward = False

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, family='gated', "
                f"feature_map={self.feature_map_name!r}, eps={self.eps}")

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        B, N = qkv.shape[0], qkv.shape[1]
        q, k, v = _split_heads(qkv)
        gate = _heads_first(torch.sigmoid(self.key_gate(x)).reshape(B, N, self.num_heads, self.head_dim))
        # the layer applies its map (a function TorchScript compiles), as LinearAttention does; the op
        # gated_linear_attention(..., feature_map name) computes the same
        phi_q = self.feature_map(to_compute_dtype(self.q_norm(q)))
        phi_k = self.feature_map(to_compute_dtype(self.k_norm(k)))
        return _tokens_last(gated_linear_attention_from_features(phi_q, phi_k, v, gate, self.eps, key_mask))


class AFTAttention(LinearAttention):
    """AFT-simple (Zhai et al. 2021): no dot product; each channel of the output is sigmoid(q) times the average of
    v over the tokens weighted by softmax over tokens of k (``linvit.ops.families.aft_simple``). Heads only group
    the channels for the optional q/k norms."""

    supports_causal = False

    def __init__(self, dim: int, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        self.fused_backward = False

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, family='aft'"

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        B, N = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.unbind(2)                                                            # [B, N, H, D]
        check_token_key_mask(key_mask)
        q = self.q_norm(q).reshape(B, N, self.attn_dim)
        k = self.k_norm(k).reshape(B, N, self.attn_dim)
        return aft_simple(q, k, v.reshape(B, N, self.attn_dim), key_mask)


#: gates are sigmoid(z) ** (1 / GATE_TEMPERATURE) as in GLA (near 1: slow forgetting); the gate projection starts
#: at weight 0 and bias GATE_INIT_BIAS, a gate of 0.9989 per token, so a new layer starts as the decay alone
GATE_TEMPERATURE = 16.0
GATE_INIT_BIAS = 4.0


def resolve_decays(decay: Any, num_heads: int) -> Optional[Tuple[float, ...]]:
    """decay option -> per-head decays (H floats) or None: 'retnet' (RetNet's schedule, ``retention_decays``),
    None (no decay), a float, or one float per head, each in (0, 1]."""
    if decay is None:
        return None
    if isinstance(decay, str):
        if decay != 'retnet':
            raise ValueError(f"decay must be 'retnet', None, a float or one float per head, got {decay!r}")
        return tuple(retention_decays(num_heads).tolist())
    values = [float(decay)] * num_heads if isinstance(decay, (int, float)) else [float(d) for d in decay]
    if len(values) != num_heads or not all(0.0 < value <= 1.0 for value in values):
        raise ValueError(f"decay must hold one value in (0, 1] (or one per head: {num_heads}), got {decay!r}")
    return tuple(values)


class BidirectionalAttention(LinearAttention):
    """Bidirectional decayed / gated linear attention over the patch grid (Vision-RWKV, ViG style): the sum of a
    forward and a backward causal scan (``linvit.ops.bidirectional_linear_attention``), along raster order and,
    with ``scan_orders='raster+column'``, also column order, so a token weighs another by decay^distance along
    rows and along columns: locality at linear cost, no window.

    decay: 'retnet' (per-head RetNet decays 1 - 2^-5 .. ), None, a float or one per head (fixed, not trained).
    data_gate: add a data-dependent per-token, per-channel gate sigmoid(scan_gate(x)) ** (1 / 16) (GLA); its
        projection starts near a gate of 1. scan_chunk_size: tokens per chunk of the scans (None: 64, 16 with the
        per-channel gate; see ``linvit.ops.causal.default_chunk_size``).
    Prefix tokens come first in every order (the class token sits next to the first patches).
    """
    supports_causal = False

    def __init__(self, dim: int, decay: Any = 'retnet', data_gate: bool = False, scan_orders: str = 'raster+column',
                 scan_chunk_size: Optional[int] = None, **kwargs) -> None:
        super().__init__(dim, **kwargs)
        if scan_orders not in SCAN_ORDERS:
            raise ValueError(f"scan_orders must be one of {list(SCAN_ORDERS)}, got {scan_orders!r}")
        if scan_chunk_size is not None and (isinstance(scan_chunk_size, bool) or not isinstance(scan_chunk_size, int)
                                            or scan_chunk_size < 1):
            raise ValueError(f"scan_chunk_size must be an int >= 1 or None, got {scan_chunk_size!r}")
        decays = resolve_decays(decay, self.num_heads)
        self.decay = decay
        self.scan_orders = scan_orders
        self.scan_chunk_size = scan_chunk_size
        self.grid_size: Optional[Tuple[int, int]]
        self.num_prefix_tokens, self.grid_size = _token_layout(kwargs)
        self.fused_backward = False
        device = self.qkv.weight.device
        # python floats, not a buffer: a fixed hyperparameter that model.half() must not round (1 - 2^-12 is 1.0
        # in bfloat16) and that the state_dict need not carry
        self.decays = decays
        self.scan_gate: Optional[nn.Linear] = None
        self.gate_temperature = GATE_TEMPERATURE  # an attribute: TorchScript reads no global floats
        if data_gate:
            self.scan_gate = nn.Linear(dim, self.attn_dim, device=device, dtype=self.qkv.weight.dtype)
            if device.type != 'meta':
                nn.init.zeros_(self.scan_gate.weight)
                nn.init.constant_(self.scan_gate.bias, GATE_INIT_BIAS)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, family='bidirectional', "
                f"feature_map={self.feature_map_name!r}, decay={self.decay!r}, "
                f"data_gate={self.scan_gate is not None}, scan_orders={self.scan_orders!r}")

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        check_no_key_mask(key_mask, 'bidirectional', 'scans the patch grid')
        B, N = qkv.shape[0], qkv.shape[1]
        grid = resolve_token_grid(N, self.num_prefix_tokens, self.grid_size, feat_size)
        orders = grid_scan_orders(grid, self.num_prefix_tokens, self.scan_orders, qkv.device)
        q, k, v = _split_heads(qkv)
        q, k = self.q_norm(q), self.k_norm(k)
        log_gate = None
        if self.scan_gate is not None:
            log_gate = _heads_first(F.logsigmoid(self.scan_gate(x)).reshape(B, N, self.num_heads, self.head_dim))
            log_gate = log_gate / self.gate_temperature
        decays: Optional[List[float]] = None
        if self.decays is not None:
            decays = [float(d) for d in self.decays]  # a list: TorchScript's type for the op's argument
        out = bidirectional_linear_attention_op(q, k, v, self.feature_map_name, decays, log_gate, self.eps,
                                                self.scan_chunk_size, orders)
        return _tokens_last(out)


#: attention family name -> layer class (every class takes LinearAttention's arguments plus FAMILY_OPTIONS)
ATTENTION_FAMILIES: Dict[str, Type[LinearAttention]] = {
    'linear': LinearAttention,
    'performer': PerformerAttention,
    'linformer': LowRankAttention,
    'gated': GatedLinearAttention,
    'aft': AFTAttention,
    'bidirectional': BidirectionalAttention,
}
#: options each family adds to LinearAttention's (``attn_options`` of the models and convert_to_linear)
FAMILY_OPTIONS: Dict[str, Tuple[str, ...]] = {
    'linear': (), 'performer': ('num_features', 'orthogonal'), 'linformer': ('low_rank_size',), 'gated': (),
    'aft': (), 'bidirectional': ('decay', 'data_gate', 'scan_orders', 'scan_chunk_size'),
}
#: families whose mixing uses a feature map (``feature_map`` applies to them only)
FAMILIES_WITH_FEATURE_MAP = ('linear', 'gated', 'bidirectional')


def list_attention_kinds() -> List[str]:
    """Every name ``attn_kernel`` accepts: the feature maps (plain linear attention with that map), then the
    other families."""
    return list_feature_maps() + [name for name in ATTENTION_FAMILIES if name != 'linear']


def resolve_attention_kind(attn_kernel: Optional[str], feature_map: Optional[str]) -> Tuple[str, Optional[str]]:
    """(family, feature map or None) from the ``attn_kernel`` and ``feature_map`` arguments.

    attn_kernel: a feature-map name (plain linear attention with it), a family name, or None (plain linear
        attention with ``feature_map``, default 'elu1'). feature_map applies to the families that use one.
    """
    if attn_kernel is None or attn_kernel in FEATURE_MAPS:
        if attn_kernel is not None and feature_map is not None and feature_map != attn_kernel:
            raise ValueError(f"attn_kernel={attn_kernel!r} (a feature map) and feature_map={feature_map!r} disagree; "
                             f"pass one of them")
        name = attn_kernel or feature_map or 'elu1'
        if name not in FEATURE_MAPS:
            raise ValueError(f"unknown feature map {name!r}; known: {list_feature_maps()}")
        return 'linear', name
    if attn_kernel not in ATTENTION_FAMILIES:
        raise ValueError(f"unknown attn_kernel {attn_kernel!r}; known: {list_attention_kinds()}")
    if attn_kernel in FAMILIES_WITH_FEATURE_MAP:
        return attn_kernel, resolve_attention_kind(None, feature_map)[1]
    if feature_map is not None:
        raise ValueError(f"attn_kernel={attn_kernel!r} uses no feature map; drop feature_map={feature_map!r}")
    return attn_kernel, None


def attention_layer(family: str = 'linear', **options: Any) -> Type[LinearAttention]:
    """A subclass of ``ATTENTION_FAMILIES[family]`` whose options default to ``options`` (timm's blocks take the
    attention as a class): LinearAttention's linear-only options (feature_map, eps, local_mix, ...) and the
    family's ``FAMILY_OPTIONS``. Unknown families and options raise ValueError."""
    if family not in ATTENTION_FAMILIES:
        raise ValueError(f"unknown attention family {family!r}; known: {list(ATTENTION_FAMILIES)}")
    allowed = _LINEAR_ONLY_OPTIONS + FAMILY_OPTIONS[family]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {family} attention options {unknown}; known: {list(allowed)}")
    if options.get('feature_map') is not None and options['feature_map'] not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {options['feature_map']!r}; known: {list_feature_maps()}")
    defaults = {k: v for k, v in options.items() if not (k == 'feature_map' and v is None)}
    return configured_layer(ATTENTION_FAMILIES[family], defaults)


def redraw_random_features(model: nn.Module, generator: Optional[torch.Generator] = None) -> int:
    """Draw new random features in every Performer layer of ``model`` (call it between steps, e.g. every K
    steps; forward never does). Returns how many layers were redrawn."""
    layers = [m for m in model.modules() if isinstance(m, PerformerAttention)]
    for layer in layers:
        layer.redraw(generator)
    return len(layers)
