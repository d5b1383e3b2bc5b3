"""LinearAttention: a drop-in for ``timm.layers.Attention`` with O(N) token mixing."""
from typing import List, Optional, Tuple, Type, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import (
    AttentionState,
    CausalState,
    causal_linear_attention,
    causal_linear_attention_step,
    check_attn_backend,
    compute_dtype,
    export_tracing,
    feature_map_spec,
    fused_linear_attention_from_features,
    has_fused_backward,
    kernels_serve,
    linear_attention_apply,
    linear_attention_from_features,
    linear_attention_state,
    normalized_attention_from_features,
    normalizer_spec,
    projected_linear_attention_from_features,
    projected_linear_attention_from_inputs,
)
from ..ops.rotary import rotary_linear_attention, rotation_from_timm
from .family import FamilySpec, register_family
from .feature_map import LearnableFeatureMap  # noqa: F401  (registers the learnable maps: 'hedgehog')
from .local_mix import LocalMix


def check_tokens(x: torch.Tensor, dim: int) -> None:
    """Raise ValueError unless x is [B, N, dim]."""
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"LinearAttention expects tokens of shape [B, N, {dim}], got {list(x.shape)}")


def check_traced_causality(is_causal: bool, traced_causal: bool) -> None:
    """Run-time check of an fx-traced layer or model: the graph was traced with its own causal mode (``traced_causal``)
    and cannot switch; raise ValueError if a call asks for causal attention where the graph is not causal."""
    if is_causal and not traced_causal:
        raise ValueError("this fx graph was traced non-causal (is_causal is fixed at tracing); trace the model with "
                         "causal=True for causal attention")


def check_no_rope(rope: Optional[torch.Tensor]) -> None:
    """Causal linear attention has no rotary form: ValueError for a rope (an fx leaf: checked at run time)."""
    if rope is not None:
        raise ValueError("causal linear attention takes no rotary embeddings (rope); the rotary form is non-causal")


def check_causal_mask(attn_mask: Optional[torch.Tensor]) -> None:
    """Causal linear attention builds its mask in: ValueError for an attn_mask (an fx leaf: checked at run time)."""
    if attn_mask is not None:
        raise ValueError("causal linear attention takes no attn_mask (the causal mask is built in)")


def causal_call(is_causal: bool, causal_default: bool) -> bool:
    """Whether a forward call attends causally: is_causal or the module's own ``causal``.

    Under torch.fx symbolic tracing is_causal is a Proxy (timm's forward takes it as an argument) that no branch can
    read: the graph keeps the module's own mode, with a node that fails at run time if a call asks for causal
    attention where the graph is not causal."""
    if torch.jit.is_scripting():
        return is_causal or causal_default
    if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        check_traced_causality(is_causal, causal_default)
        return causal_default
    return is_causal or causal_default


def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an nn.Linear whose forward is F.linear of its weight and bias: not a subclass (LoRA,
    quantised wrappers) and without hooks, so code that reads its weight computes what calling it would."""
    return type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks


def exporting() -> bool:
    """Whether the call is being exported or traced (torch.onnx's exporters, torch.jit.trace, torch.export's
    non-strict tracing, which linvit.export uses: ``linvit.ops.export_tracing``): then the layers take the PyTorch
    path, whose graph of aten ops every exporter and runtime knows, rather than the registered op or the autograd
    Function. A plain torch.compile and a strict torch.export keep the op."""
    return torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or export_tracing()


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """Cast to the attention core's dtype (float32, or float64 for float64 inputs)."""
    return x.to(compute_dtype(x.dtype))


def attn_mask_to_key_mask(attn_mask: Optional[torch.Tensor], batch: int, n_tokens: int) -> Optional[torch.Tensor]:
    """Turn an SDPA-style mask that only masks keys into a key mask for the linear-attention core.

    attn_mask: None, or [B, N], [B, 1, 1, N] or [B, H, 1, N]; bool (True attends) or float (added to the softmax
    logits, so a key's weight becomes exp(mask): 0 keeps it, -inf drops it). Returns None, bool or float weights
    of shape [B, N] or [B, H, N]. A mask with a query dimension of N cannot be applied in linear time: ValueError.
    """
    if attn_mask is None:
        return None
    shape = list(attn_mask.shape)
    if attn_mask.dim() == 4 and shape[0] == batch and shape[2] == 1 and shape[3] == n_tokens:
        mask = attn_mask[:, :, 0, :]
        mask = mask[:, 0, :] if shape[1] == 1 else mask
    elif shape == [batch, n_tokens]:
        mask = attn_mask
    else:
        raise ValueError(f"LinearAttention supports key-padding masks only: attn_mask of shape [B, N], "
                         f"[B, 1, 1, N] or [B, H, 1, N] with B={batch}, N={n_tokens}; got {shape}")
    if mask.dtype == torch.bool:
        return mask
    return torch.exp(mask.to(compute_dtype(mask.dtype)))


torch.fx.wrap('check_tokens')
torch.fx.wrap('check_traced_causality')
torch.fx.wrap('check_causal_mask')
torch.fx.wrap('check_no_rope')
torch.fx.wrap('to_compute_dtype')
torch.fx.wrap('attn_mask_to_key_mask')
torch.fx.wrap('linear_attention_from_features')
torch.fx.wrap('fused_linear_attention_from_features')
torch.fx.wrap('normalized_attention_from_features')
torch.fx.wrap('causal_linear_attention')


class LinearAttention(nn.Module):
    """Multi-head linear attention with timm's ``Attention`` interface and parameter names.

    The constructor takes timm's arguments (so ``VisionTransformer(attn_layer=LinearAttention)`` works) and
    creates the same parameters (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``), so a softmax
    checkpoint loads unchanged. Token mixing is phi(q)^T phi(k) normalised linear attention in float32
    (see ``linvit.ops.linear_attention``). ``attn_drop`` must be 0: there is no attention matrix to drop out.

    Extra options:
        feature_map: a name in ``linvit.ops.FEATURE_MAPS``: a fixed map or a learnable one (e.g. 'hedgehog';
            ``linvit.layers.feature_map``), which the layer
            holds as its submodule ``feature_map`` (plain linear attention, non-causal).
        eps: added to the mean normaliser.
        normalizer: how similarities become weights, a name in ``linvit.ops.NORMALIZERS``: 'divide' (plain linear
            attention), 'inline' (InLine's injective normaliser) or 'mala' (MALA's magnitude-aware one); the
            families that declare ``FamilySpec.normalizer``. Only 'divide' has the fast paths (the registered op,
            its kernels, the projection folds), the state form and the rotary form (``NormalizerSpec.fast_paths``).
        local_mix: add a zero-initialised depthwise-conv branch on V over the 2D token grid
            (``local_mix_kernel`` x ``local_mix_kernel``). Its parameters ``local_mix.conv.*`` are the only ones a
            softmax checkpoint lacks. The grid is found as ``linvit.layers.local_mix`` documents, using
            ``num_prefix_tokens`` (class + register tokens before the patches) and ``grid_size``.

        causal: attend causally by default (token i sees tokens 0..i), as ``forward(x, is_causal=True)`` does:
            "Transformers are RNNs" - trained in parallel through the chunked scan with its memory-efficient backward
            (``linvit.ops.causal``), run token by token with ``step``. Needs local_mix=False (the convolution sees
            later patches) and no attn_mask.
        causal_chunk_size: tokens per chunk of the causal scan.
        attn_backend: who computes the non-causal core (``linvit.ops.ATTN_BACKENDS``): 'auto' (the Triton
            kernels of ``linvit.ops.linear_attn.op`` on CUDA tensors they serve, the PyTorch path elsewhere),
            'triton' (the kernels always; an error says why when they cannot serve a call) or 'torch'.
        rotate_half: the feature-pair layout of rotary embeddings passed to ``forward(x, rope=...)`` (timm's
            ``rotate_half``: False interleaved, True halves).

    forward: x [B, N, dim] -> [B, N, dim_out]; attn_mask is an optional key-padding mask (see
    ``attn_mask_to_key_mask``); feat_size (H, W) is the patch grid for the local branch; rope is timm's rotary
    embedding of the patch tokens [..., N - num_prefix_tokens, 2 D] ([sin | cos], as timm's RoPE models pass it):
    the queries and keys then attend at their positions (``linvit.ops.rotary``; families with ``FamilySpec.rotary``).
    step: x_t [B, dim] and the state after the previous tokens -> ([B, dim_out], state): the recurrent form.

    The other attention families (``linvit.layers.families``) subclass it, replace ``mix`` and declare themselves
    as this class does (``linvit.layers.family.FamilySpec``).
    """

    #: plain linear attention: a feature map, a causal form, no tensors beyond timm's Attention
    family = FamilySpec('linear', feature_map=True, causal=True, state=True, rotary=True, normalizer=True)
    grid_size: Optional[Tuple[int, int]]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            attn_head_dim: Optional[int] = None,
            dim_out: Optional[int] = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            gated: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            feature_map: str = 'elu1',
            eps: float = 1e-6,
            normalizer: str = 'divide',
            local_mix: bool = False,
            local_mix_kernel: int = 3,
            num_prefix_tokens: int = 1,
            grid_size: Optional[Tuple[int, int]] = None,
            causal: bool = False,
            causal_chunk_size: int = 64,
            attn_backend: str = 'auto',
            rotate_half: bool = False,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if attn_head_dim is None and dim % num_heads != 0:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}; pass attn_head_dim")
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("qk_norm and scale_norm need a norm_layer")
        if attn_drop > 0:
            raise ValueError(f"attn_drop={attn_drop}: linear attention forms no attention matrix to drop out; "
                             f"use proj_drop or drop_path instead")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        check_attn_backend(attn_backend)
        fast_normalizer = self._checked_normalizer(normalizer, causal, attn_backend)
        map_spec = feature_map_spec(feature_map)
        learnable = map_spec.learnable
        if learnable and type(self).mix is not LinearAttention.mix:
            raise ValueError(f"feature_map={feature_map!r} is learnable, which plain linear attention "
                             f"(attn_family='linear') supports; {type(self).__name__} mixes tokens its own way")
        if learnable and causal:
            raise ValueError(_CAUSAL_LEARNABLE.format(feature_map))
        if learnable and attn_backend == 'triton':
            raise ValueError(f"attn_backend='triton': the Triton kernels apply a fixed feature map (elu1, relu); "
                             f"feature_map={feature_map!r} is learnable and runs on the PyTorch path "
                             f"(attn_backend='auto' or 'torch')")
        if causal and not type(self).family.causal:
            raise ValueError(self._no_causal_form())
        if causal and local_mix:
            raise ValueError(_CAUSAL_LOCAL_MIX)
        if causal and attn_backend == 'triton':
            raise ValueError(_CAUSAL_TRITON)
        if isinstance(causal_chunk_size, bool) or not isinstance(causal_chunk_size, int) or causal_chunk_size < 1:
            raise ValueError(f"causal_chunk_size must be an int >= 1, got {causal_chunk_size!r}")
        if attn_backend == 'triton' and type(self).mix is not LinearAttention.mix:
            raise ValueError(f"attn_backend='triton': the Triton kernels compute plain linear attention, and "
                             f"{type(self).__name__} mixes tokens its own way; use attn_backend='auto'")
        head_dim = attn_head_dim if attn_head_dim is not None else dim // num_heads
        dim_out = dim_out or dim
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.feature_map_name = feature_map
        # a learnable map is a submodule holding its parameters (state-dict keys feature_map.*), called like a
        # fixed map on [B, H, N, D]; its output width may differ from D (hedgehog: 2 D)
        self.learnable_map = learnable
        self.feature_map = map_spec.module(num_heads, head_dim, **dd) if learnable else map_spec.fn
        # without autograd a fixed map is written into the fresh qkv projection output rather than a new tensor
        self.feature_map_inplace = _no_inplace_form if learnable else map_spec.inplace or self.feature_map
        # with autograd, maps that have a registered derivative train through the fused Function
        # (linvit.ops.linear_attn.function), which computes plain linear attention only: a family with its own mix
        # never takes it
        self.fused_backward = has_fused_backward(feature_map) and type(self).mix is LinearAttention.mix \
            and fast_normalizer
        self.eps = eps
        self.normalizer = normalizer
        # whether the fast paths (op, kernels, projection folds), the state form and the rotary form compute it
        self.fast_normalizer = fast_normalizer
        self.causal = causal
        self.causal_chunk_size = causal_chunk_size
        self.attn_backend = attn_backend
        # the token layout, for the families that read the patch grid (FamilySpec.token_grid): their fallback
        # without feat_size; linvit models and convert_to_linear set both
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_size = None if grid_size is None else (int(grid_size[0]), int(grid_size[1]))
        self.rotate_half = rotate_half

        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.local_mix = LocalMix(self.attn_dim, local_mix_kernel, num_prefix_tokens, grid_size, **dd) \
            if local_mix else None
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def _checked_normalizer(self, normalizer: str, causal: bool, attn_backend: str) -> bool:
        """``NormalizerSpec.fast_paths`` of ``normalizer``; ValueError for an unknown name, a family that does not
        declare the option, or a combination only the fast paths have (causal, the Triton backend)."""
        spec = normalizer_spec(normalizer)
        if spec.fast_paths:
            return True
        if not type(self).family.normalizer:
            raise ValueError(f"normalizer={normalizer!r}: attn_family={type(self).family.name!r} mixes tokens its own "
                             f"way and takes no normalizer")
        if causal:
            raise ValueError(f"normalizer={normalizer!r} has no causal form; causal attention divides "
                             f"(normalizer='divide')")
        if attn_backend == 'triton':
            raise ValueError(f"attn_backend='triton': the Triton kernels divide (normalizer='divide'); "
                             f"normalizer={normalizer!r} runs on the PyTorch path (attn_backend='auto' or 'torch')")
        return False

    def extra_repr(self) -> str:
        # print(model) should say what each block computes: the family and its declared options, the map, eps and
        # whether the local branch is on
        spec = type(self).family
        parts = [f"family={spec.name!r}", f"dim={self.dim}", f"num_heads={self.num_heads}", f"head_dim={self.head_dim}"]
        parts += [f"{name}={getattr(self, name)!r}" for name in spec.options]
        if spec.feature_map:
            parts.append(f"feature_map={self.feature_map_name!r}")
        if not self.fast_normalizer:
            parts.append(f"normalizer={self.normalizer!r}")
        local = 'off' if self.local_mix is None else f"{self.local_mix.kernel_size}x{self.local_mix.kernel_size}"
        parts += [f"eps={self.eps}", f"local_mix={local}"]
        if self.causal:
            parts.append('causal=True')
        if self.attn_backend != 'auto':
            parts.append(f"attn_backend={self.attn_backend!r}")
        return ', '.join(parts)

    @torch.jit.unused
    def _mix_tokens_op(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """qkv [B, N, 3, H, D] -> attention output [B, N, H * D] through the registered op
        (``linvit.ops.linear_attn.op``), which picks its implementation per call: the Triton kernels for CUDA tensors
        they serve, the fused PyTorch path otherwise (``attn_backend`` can force either). The op keeps qkv (or q, k,
        v) for backward plus the small state and per-row normalisers, and returns the output token-major, so the
        reshape below is a view."""
        B, N = qkv.shape[0], qkv.shape[1]
        # the ops themselves, not their checking wrappers: the layer's own projection made qkv, the layer checked
        # its options once, and under fx the graph holds the op (which TorchScript can call)
        name, eps, backend = self.feature_map_name, self.eps, self.attn_backend
        if isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity):
            out = torch.ops.linvit.linear_attention_qkv(qkv, name, eps, key_mask, backend)[0]
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            out = torch.ops.linvit.linear_attention(self.q_norm(q), self.k_norm(k), v, name, eps, key_mask,
                                                    backend)[0].transpose(1, 2)
        return out.reshape(B, N, self.attn_dim)

    @torch.jit.unused
    def _core_is_op(self, key_mask: Optional[torch.Tensor]) -> bool:
        """Whether the token mixing is the registered op: plain linear attention with a fixed map whose derivative
        the op's closed-form backward knows (``fused_backward``), and a constant key mask. Device, dtype, grad mode
        and compilation do not enter: the op decides what runs, so eager, compiled and CUDA-graph calls, training
        and inference, take one path."""
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            return self.fused_backward  # key_mask is a Proxy there, whose requires_grad no branch can read
        return self.fused_backward and not (key_mask is not None and key_mask.requires_grad)

    @torch.jit.unused
    def _op_runs_kernels(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor]) -> bool:
        """Whether the op would run the Triton kernels for this call (then no PyTorch-path fold replaces it)."""
        if not self._core_is_op(key_mask):
            return False
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return kernels_serve(self.attn_backend, q, k, v, self.feature_map_name, key_mask)

    def _mix_tokens(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """qkv [B, N, 3, H, D] -> attention output [B, N, H * D] by the float32 core on mapped features (inference,
        TorchScript, maps without a registered derivative)."""
        B, N = qkv.shape[0], qkv.shape[1]
        phi_q, phi_k, v = self._features(qkv)
        mixed = self._attend_features(phi_q, phi_k, v, key_mask)
        return mixed.to(qkv.dtype).transpose(1, 2).reshape(B, N, self.attn_dim)

    def _features(self, qkv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, N, 3, H, D] -> (phi(q) [B, H, N, F], phi(k) [B, H, N, F], v [B, H, N, D]) in the compute dtype."""
        phi_q, phi_k = self._qk_features(qkv[:, :, :2])
        return phi_q, phi_k, to_compute_dtype(qkv[:, :, 2].transpose(1, 2))

    def _qk_features(self, qk: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """qk [B, N, 2, H, D] (q and k) -> (phi(q) [B, H, N, F], phi(k) [B, H, N, F]) in the compute dtype."""
        qkv = qk.permute(2, 0, 3, 1, 4)
        if self.learnable_map or torch.compiler.is_compiling() or not (isinstance(self.q_norm, nn.Identity)
                                                                       and isinstance(self.k_norm, nn.Identity)):
            # compiled code maps q and k out of place, in two calls even without autograd: inductor fuses them
            # into one kernel that writes phi head-major into two buffers. Measured per layer at 16k tokens, the
            # in-place form (compiled to a copy-back) was 15% slower and one [2, B, H, N, D] buffer 9% slower:
            # past glibc's 32 MiB mmap threshold, a buffer's pages are faulted in afresh on every call
            phi_q = self.feature_map(to_compute_dtype(self.q_norm(qkv[0])))
            phi_k = self.feature_map(to_compute_dtype(self.k_norm(qkv[1])))
        elif torch.is_grad_enabled():
            # one feature-map call on the q|k view: half the kernel launches, which dominate at 224 px
            phi_q, phi_k = self.feature_map(to_compute_dtype(qkv[:2])).unbind(0)
        else:
            # eager inference: nothing keeps q and k for a backward pass, so map them in place inside the qkv
            # output (v untouched), saving a large fresh allocation and its page faults
            phi_q, phi_k = self.feature_map_inplace(to_compute_dtype(qkv[:2])).unbind(0)
        return phi_q, phi_k

    @torch.jit.unused
    def _feeds_plain_projection(self) -> bool:
        """Whether this call's attention output may go straight into a folded ``proj``: inference (no autograd) of
        plain linear attention (no local branch, output norm or gate), ``proj`` a plain nn.Linear without hooks,
        outside fx tracing and export (which keep the unfolded graph)."""
        if torch.is_grad_enabled() or type(self).mix is not LinearAttention.mix or not self.fast_normalizer:
            return False
        if self.local_mix is not None or self.gate is not None or not isinstance(self.norm, nn.Identity):
            return False
        if not _plain_linear(self.proj):
            return False  # the fold reads proj's weight and bias: a subclass (LoRA, quantised) or hook would be skipped
        return not (torch.fx._symbolic_trace.is_fx_symbolic_tracing() or exporting())

    @torch.jit.unused
    def _projects_in_core(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor]) -> bool:
        """Whether this call folds the output projection into the attention core
        (``linvit.ops.projected_linear_attention_from_features``: no query-side matmul): ``_feeds_plain_projection``,
        on the PyTorch path, with qkv already in the core's dtype (not under autocast), so the projection keeps its
        precision."""
        if not self._feeds_plain_projection():
            return False
        if qkv.dtype != compute_dtype(qkv.dtype) or self.proj.weight.dtype != qkv.dtype:
            return False  # also under autocast, whose qkv projection returns its lower precision
        return not self._op_runs_kernels(qkv, key_mask)

    @torch.jit.unused
    def _projects_values_in_core(self, x: torch.Tensor, key_mask: Optional[torch.Tensor]) -> bool:
        """Whether this call also folds the value projection (``linvit.ops.projected_linear_attention_from_inputs``:
        no V and no key-side per-head matmul): the conditions of ``_projects_in_core``, read from the layer input
        before qkv exists, and in addition no key mask, ``qkv`` a plain nn.Linear without hooks, and features no
        wider than the values (F <= D: phi(K)^T X then costs no more than the value projection it replaces)."""
        if key_mask is not None or not self._feeds_plain_projection() or not _plain_linear(self.qkv):
            return False
        if self._feature_width() > self.head_dim:
            return False
        dtype = compute_dtype(x.dtype)
        if x.dtype != dtype or self.qkv.weight.dtype != dtype or self.proj.weight.dtype != dtype:
            return False
        if torch.is_autocast_enabled(x.device.type):
            return False  # the qkv projection would run in autocast's lower precision, the fold in the core's
        # the registered op's Triton kernels serve these calls (judged from a head-wide view of the input, which
        # has qkv's device and dtype here: qkv does not exist yet)
        head = x[..., :self.head_dim].unsqueeze(1)
        return not (self._core_is_op(key_mask) and kernels_serve(self.attn_backend, head, head, head,
                                                                 self.feature_map_name, key_mask))

    def _feature_width(self) -> int:
        """F, the width of phi's output: the learnable map's ``num_features``, D for the fixed maps."""
        return int(self.feature_map.num_features) if self.learnable_map else self.head_dim

    @torch.jit.unused
    def _mix_and_project(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """qkv [B, N, 3, H, D] -> proj(attention output) [B, N, dim_out], the projection folded into the core."""
        phi_q, phi_k, v = self._features(qkv)
        return projected_linear_attention_from_features(phi_q, phi_k, v, self.proj.weight, self.proj.bias, self.eps,
                                                        key_mask)

    @torch.jit.unused
    def _project_values_in_core(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, dim] -> proj(attention output) [B, N, dim_out] with the value and output projections folded
        into the core: only q and k are projected."""
        B, N, _ = x.shape
        qk_rows = 2 * self.attn_dim
        weight, bias = self.qkv.weight, self.qkv.bias
        qk = F.linear(x, weight[:qk_rows], None if bias is None else bias[:qk_rows])
        phi_q, phi_k = self._qk_features(qk.reshape(B, N, 2, self.num_heads, self.head_dim))
        return projected_linear_attention_from_inputs(phi_q, phi_k, x, weight[qk_rows:],
                                                      None if bias is None else bias[qk_rows:], self.proj.weight,
                                                      self.proj.bias, self.eps)

    def _attend_features(self, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                         key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The float32 core on mapped features: phi_q [B, H, N, F], phi_k [B, H, N, F], v [B, H, N, D] ->
        [B, H, N, D]. A learnable map trains the core through the fused Function (closed-form backward; the map's
        own parameters through autograd up to its features); everything else through linear_attention_from_features."""
        if torch.jit.is_scripting():  # TorchScript cannot compile an autograd.Function
            if not self.fast_normalizer:
                raise RuntimeError("a scripted LinearAttention divides (normalizer='divide'); run the others eager, "
                                   "compiled or exported")
            return linear_attention_from_features(phi_q, phi_k, v, self.eps, key_mask)
        return self._attend_features_eager(phi_q, phi_k, v, key_mask)

    @torch.jit.unused
    def _attend_features_eager(self, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                               key_mask: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.fast_normalizer:  # the normaliser's closed form, by plain autograd (an fx leaf)
            return normalized_attention_from_features(phi_q, phi_k, v, self.normalizer, self.eps, key_mask)
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():  # fx keeps the core as its leaf (plain autograd)
            return linear_attention_from_features(phi_q, phi_k, v, self.eps, key_mask)
        if self.learnable_map and torch.is_grad_enabled() and not exporting() \
                and not (key_mask is not None and key_mask.requires_grad):
            return fused_linear_attention_from_features(phi_q, phi_k, v, self.eps, key_mask)
        return linear_attention_from_features(phi_q, phi_k, v, self.eps, key_mask)

    def mix(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], x: torch.Tensor,
            feat_size: Optional[List[int]]) -> torch.Tensor:
        """The token mixing: qkv [B, N, 3, H, D] (and the layer input x [B, N, dim], the patch grid) -> [B, N, H * D].
        The other attention families (``linvit.layers.families``) override this and keep the rest of the layer."""
        if torch.jit.is_scripting():  # TorchScript cannot compile an autograd.Function: this branch hides it
            return self._mix_tokens(qkv, key_mask)
        if exporting():  # exporters get the aten ops of the PyTorch path
            return self._mix_tokens(qkv, key_mask)
        if self._core_is_op(key_mask):
            return self._mix_tokens_op(qkv, key_mask)
        return self._mix_tokens(qkv, key_mask)

    @torch.jit.unused
    def mix_causal(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal token mixing: qkv [B, N, 3, H, D] -> [B, N, H * D], token i from tokens 0..i (chunked scan)."""
        B, N = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = causal_linear_attention(self.q_norm(q), self.k_norm(k), v, self.feature_map_name, eps=self.eps,
                                      form='chunked', chunk_size=self.causal_chunk_size)
        return out.transpose(1, 2).reshape(B, N, self.attn_dim)

    def _no_causal_form(self) -> str:
        return (f"{type(self).__name__} has no causal form (causal=True / is_causal=True); causal attention is plain "
                f"linear attention (attn_family='linear', any feature map)")

    @torch.jit.unused
    def _check_causal_call(self, attn_mask: Optional[torch.Tensor]) -> None:
        if not type(self).family.causal:
            raise ValueError(self._no_causal_form())
        if self.learnable_map:
            raise ValueError(_CAUSAL_LEARNABLE.format(self.feature_map_name))
        if self.local_mix is not None:
            raise ValueError(_CAUSAL_LOCAL_MIX)
        if self.attn_backend == 'triton':
            raise ValueError(_CAUSAL_TRITON)
        if not self.fast_normalizer:
            raise ValueError(f"normalizer={self.normalizer!r} has no causal form; causal attention divides "
                             f"(normalizer='divide')")
        check_causal_mask(attn_mask)

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output norm, timm's gate and the projection: out [..., H * D] (x [..., dim] the layer input)."""
        out = self.norm(out)
        if self.gate is not None:
            out = out * self.gate(x).sigmoid()
        out = self.proj(out)
        return self.proj_drop(out)

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
            feat_size: Optional[List[int]] = None,
            rope: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        check_tokens(x, self.dim)
        B, N, _ = x.shape
        if causal_call(is_causal, self.causal):
            self._check_causal_call(attn_mask)
            check_no_rope(rope)
            return self._finish(self.mix_causal(self.project_qkv(x)), x)
        key_mask = attn_mask_to_key_mask(attn_mask, B, N)
        if rope is None and not torch.jit.is_scripting() and self._projects_values_in_core(x, key_mask):
            return self.proj_drop(self._project_values_in_core(x))
        qkv = self.project_qkv(x)
        if rope is None and not torch.jit.is_scripting() and self._projects_in_core(qkv, key_mask):
            return self.proj_drop(self._mix_and_project(qkv, key_mask))
        if rope is None:
            out = self.mix(qkv, key_mask, x, feat_size)
        else:
            out = self.mix_rotary(qkv, key_mask, rope)
        v = qkv[:, :, 2].transpose(1, 2)
        if self.local_mix is not None:
            out = self.local_mix.add_to(out, v, feat_size)
        return self._finish(out, x)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, dim] -> the queries, keys and values [B, N, 3, H, D] (before the q / k norms)."""
        B, N, _ = x.shape
        return self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)

    @torch.jit.unused
    def mix_rotary(self, qkv: torch.Tensor, key_mask: Optional[torch.Tensor], rope: torch.Tensor) -> torch.Tensor:
        """Token mixing at rotary positions: qkv [B, N, 3, H, D] and timm's embedding rope [..., N - P, 2 D] of the
        patch tokens (P = num_prefix_tokens, not turned) -> [B, N, H * D] (``linvit.ops.rotary``)."""
        if not type(self).family.rotary:
            raise ValueError(f"attn_family={type(self).family.name!r} takes no rotary position embeddings (rope): "
                             f"plain linear attention (attn_family='linear') does")
        if not self.fast_normalizer:
            raise ValueError(f"normalizer={self.normalizer!r} has no rotary form (rope); normalizer='divide' has")
        B, N = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        rotation = rotation_from_timm(rope, self.num_prefix_tokens, self.rotate_half)
        out = rotary_linear_attention(self.q_norm(q), self.k_norm(k), v, rotation, self._state_map(), self.eps,
                                      key_mask)
        return out.transpose(1, 2).reshape(B, N, self.attn_dim)

    # ---- the state form: attention in two halves (FamilySpec.state), for inputs read a part at a time

    def _check_state_form(self) -> None:
        if not type(self).family.state:
            raise ValueError(f"attn_family={type(self).family.name!r} has no state form (FamilySpec.state): its "
                             f"tokens cannot attend a part at a time; plain linear attention (attn_family='linear') "
                             f"can")
        if self.causal:
            raise ValueError("the state form is non-causal attention; this layer is causal")
        if not self.fast_normalizer:
            raise ValueError(f"normalizer={self.normalizer!r} has no state form: the state holds no mean of the "
                             f"values it needs; normalizer='divide' has")

    def _projection(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """x [B, n, dim] -> q (part 0), k (1) or v (2) [B, H, n, D]: only that third of the qkv projection."""
        B, n, _ = x.shape
        rows = slice(part * self.attn_dim, (part + 1) * self.attn_dim)
        if _plain_linear(self.qkv):
            bias = None if self.qkv.bias is None else self.qkv.bias[rows]
            y = F.linear(x, self.qkv.weight[rows], bias)
        else:  # a wrapped projection (LoRA, hooks) is called whole, as forward calls it
            y = self.qkv(x)[..., rows]
        return y.reshape(B, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _state_map(self) -> Union[str, nn.Module]:
        """The feature map the state ops take: a fixed map by name, so that they run the registered ops, whose
        backward keeps k, v and q instead of every intermediate of the map (a block then saves as much for backward
        as the plain forward, 22% less than with plain autograd), and the Triton passes on CUDA; a learnable map as
        its module."""
        return self.feature_map if self.learnable_map else self.feature_map_name

    @torch.jit.unused
    def attention_state(self, x: torch.Tensor) -> AttentionState:
        """Layer inputs x [B, n, dim] of any subset of the tokens -> the state of their keys and values
        (``linvit.ops.AttentionState``). States of disjoint subsets add up (``linvit.ops.add_states``); with the
        state of all tokens, ``attend_state`` gives each token what ``forward`` gives it."""
        self._check_state_form()
        return linear_attention_state(self.k_norm(self._projection(x, 1)), self._projection(x, 2), self._state_map())

    @torch.jit.unused
    def attend_state(self, x: torch.Tensor, state: AttentionState, band: Optional[Tuple[int, int, int]] = None
                     ) -> torch.Tensor:
        """Layer inputs x [B, n, dim] attending to the keys summarised by ``state`` -> [B, n', dim_out].

        band: None for tokens off the patch grid (prefix tokens: no local term, n' = n); or (rows, top, bottom)
            when x holds ``rows`` whole rows of the patch grid in raster order, of which the first ``top`` and the
            last ``bottom`` are only the halo the local convolution reads: their outputs are left out
            (n' = n - (top + bottom) * n / rows).
        """
        self._check_state_form()
        if band is None:
            kept = x
        else:
            rows, top, bottom = band
            width = x.shape[1] // rows
            kept = x[:, top * width:(rows - bottom) * width]
        out = linear_attention_apply(self.q_norm(self._projection(kept, 0)), state, self._state_map(), self.eps)
        B, n = kept.shape[0], kept.shape[1]
        out = out.transpose(1, 2).reshape(B, n, self.attn_dim)
        if self.local_mix is not None and band is not None:
            term = self.local_mix.patch_term(self._projection(x, 2), [rows, width], num_prefix_tokens=0)
            out = out + term[:, top * width:(rows - bottom) * width]
        return self._finish(out, kept)

    @torch.jit.unused
    def step(self, x_t: torch.Tensor, state: Optional[CausalState] = None) -> Tuple[torch.Tensor, CausalState]:
        """The recurrent form: one token x_t [B, dim] after the tokens summarised by ``state`` (None: the first
        token) -> (output [B, dim_out], new state). Feeding tokens 0..N-1 gives forward(x, is_causal=True)'s rows;
        the state (``linvit.ops.CausalState``, [B, H, D, D + 1] per layer) does not grow with N."""
        if x_t.dim() != 2 or x_t.shape[-1] != self.dim:
            raise ValueError(f"LinearAttention.step expects one token per sample [B, {self.dim}], got "
                             f"{list(x_t.shape)}")
        self._check_causal_call(None)
        q, k, v = self.project_qkv(x_t.unsqueeze(1))[:, 0].unbind(1)
        out, state = causal_linear_attention_step(self.q_norm(q), self.k_norm(k), v, state, self.feature_map,
                                                  eps=self.eps)
        return self._finish(out.reshape(x_t.shape[0], self.attn_dim), x_t), state


_CAUSAL_LOCAL_MIX = ("causal attention needs local_mix=False: the local branch convolves over neighbouring patches, "
                     "later ones included")
_CAUSAL_LEARNABLE = ("causal attention needs a fixed feature map (linvit.ops.FEATURE_MAPS); feature_map={!r} is "
                     "learnable (non-causal linear attention only)")


def _no_inplace_form(x: torch.Tensor) -> torch.Tensor:
    """The in-place slot of a layer whose map is learnable: never called (such layers map out of place)."""
    raise RuntimeError("a learnable feature map has no in-place form")


_CAUSAL_TRITON = ("attn_backend='triton': the Triton kernels compute non-causal attention; causal attention runs the "
                  "chunked scan of linvit.ops.causal (use attn_backend='auto')")
#: LinearAttention's own options, which every family takes besides its declared ones (``attn_options``)
LINEAR_OPTIONS = ('feature_map', 'eps', 'normalizer', 'local_mix', 'local_mix_kernel', 'num_prefix_tokens', 'grid_size',
                  'causal', 'causal_chunk_size', 'attn_backend', 'rotate_half')

register_family(LinearAttention)


def linear_attention_layer(**options) -> Type[LinearAttention]:
    """A LinearAttention subclass whose linear-attention options default to ``options``.

    timm's blocks accept ``attn_layer`` as a class (not a partial), so use this to choose the options:
    ``VisionTransformer(attn_layer=linear_attention_layer(feature_map='relu', local_mix=True), ...)``.
    Options are validated here: unknown names and unknown feature maps raise ValueError.
    """
    unknown = sorted(set(options) - set(LINEAR_OPTIONS))
    if unknown:
        raise ValueError(f"unknown LinearAttention options {unknown}; known: {list(LINEAR_OPTIONS)}")
    if 'feature_map' in options:
        feature_map_spec(options['feature_map'])
    return configured_layer(LinearAttention, options)


def configured_layer(base: Type[LinearAttention], options: dict) -> Type[LinearAttention]:
    """A subclass of ``base`` whose constructor options default to ``options`` (already validated)."""
    defaults = dict(options)

    class Configured(base):
        def __init__(self, dim: int, **kwargs) -> None:
            super().__init__(dim, **{**defaults, **kwargs})

    # printed models show the base class (LinearAttention(...)) with its options, not the subclass's internal name
    Configured.__name__ = base.__name__
    Configured.__qualname__ = f"{base.__name__}[{', '.join(f'{k}={v!r}' for k, v in defaults.items())}]"
    return Configured
