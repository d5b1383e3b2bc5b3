"""Inductor graph passes linvit adds to its compiles (``linvit.fast.compiler._inductor_options``).

A module of its own because ``torch._inductor`` loads dynamo, which costs seconds per process: ``import linvit``
and every command line that never compiles leave it unloaded, and ``linvit.fast.UnfuseCpuBiasAdd`` loads it on
first use.
"""
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import is_pointwise_use

__all__ = ['UnfuseCpuBiasAdd', 'UNFUSE_CPU_BIAS_ADD']


class UnfuseCpuBiasAdd(CustomGraphPass):
    """Inductor post-grad pass: on CPU, ``addmm(bias, a, b)`` whose users are all pointwise becomes ``mm(a, b) + bias``.

    The CPU addmm first broadcasts the bias into its whole output and then accumulates the product onto it (beta=1):
    one extra write and read of an [N, out] buffer. Split off, the bias add fuses into the pointwise kernel that
    follows anyway (GELU after fc1, the residual add after proj and fc2), so the pass removes a full memory pass per
    linear layer; inductor already does this on GPUs. On a 2-core CPU, ViT-S fc1's bias broadcast alone took 19 ms
    per block at 16k tokens, and whole compiled ViT-S models (linvit, floor, timm softmax) ran 1-8% faster with the
    pass from 224 to 2048 px. Only float32/float64 addmm with alpha = beta = 1 and a 1-D bias is rewritten: in half
    precision the fused form rounds once instead of twice.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.find_nodes(op='call_function', target=torch.ops.aten.addmm.default)):
            if self._rewritable(node):
                bias, mat1, mat2 = node.args[:3]
                with graph.inserting_before(node):
                    product = graph.call_function(torch.ops.aten.mm.default, (mat1, mat2))
                    product.meta.update(node.meta)
                    biased = graph.call_function(torch.ops.aten.add.Tensor, (product, bias))
                    biased.meta.update(node.meta)
                node.replace_all_uses_with(biased)
                graph.erase_node(node)

    @staticmethod
    def _rewritable(node: torch.fx.Node) -> bool:
        if node.kwargs.get('alpha', 1) != 1 or node.kwargs.get('beta', 1) != 1 or len(node.args) != 3:
            return False
        out, bias = node.meta.get('val'), getattr(node.args[0], 'meta', {}).get('val')
        if not isinstance(out, torch.Tensor) or not isinstance(bias, torch.Tensor):
            return False
        if out.device.type != 'cpu' or out.dtype not in (torch.float32, torch.float64) or bias.dtype != out.dtype:
            return False
        if bias.dim() != 1 or out.dim() != 2 or bias.shape[0] != out.shape[1]:
            return False
        return bool(node.users) and all(is_pointwise_use(user) for user in node.users)

    def uuid(self) -> str:
        return 'linvit-unfuse-cpu-bias-add-v1'


#: the instance every compile adds (one object: inductor keys its cache by the pass's uuid)
UNFUSE_CPU_BIAS_ADD = UnfuseCpuBiasAdd()
