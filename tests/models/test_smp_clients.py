"""An outside client: segmentation_models_pytorch (a dev extra) builds its DPT on a ``tu-linvit_*`` encoder, which
timm creates as linvit's own model, and trains and predicts with it at non-square sizes.

smp's UPerNet is not here: smp accepts only hierarchical encoders for it (feature strides 4, 8, 16, 32) and refuses
every plain ViT, timm's own included ("Unsupported model downsampling pattern"); linvit's ``seg.head=upernet`` is the
UPerNet for plain ViTs (tests/models/test_heads.py)."""
import pytest
import torch
import torch.nn.functional as F

import linvit

smp = pytest.importorskip('segmentation_models_pytorch', reason='the dev extra: pip install -e .[dev]')


def test_smp_dpt_on_a_linvit_encoder_trains_and_predicts_at_non_square_sizes():
    torch.manual_seed(0)
    model = smp.DPT(encoder_name='tu-linvit_tiny_patch16_224', encoder_weights=None, classes=3,
                    dynamic_img_size=True, decoder_intermediate_channels=(32, 64, 96, 128), decoder_fusion_channels=32)
    encoder = model.encoder.model
    assert isinstance(encoder, linvit.LinearVisionTransformer)
    assert all(isinstance(block.attn, linvit.layers.LinearAttention) for block in encoder.blocks)
    images, masks = torch.randn(2, 3, 64, 96), torch.randint(0, 3, (2, 64, 96))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = encoder.blocks[0].attn.qkv.weight.detach().clone()
    loss = F.cross_entropy(model(images), masks)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and not torch.equal(encoder.blocks[0].attn.qkv.weight, before)  # the encoder trains
    model.eval()
    with torch.no_grad():
        for height, width in ((64, 96), (128, 64)):  # even patch grids: smp's fusion upsamples by 2
            out = model(torch.randn(1, 3, height, width))
            assert out.shape == (1, 3, height, width) and torch.isfinite(out).all()
