"""An outside client: segmentation_models_pytorch (a dev extra) builds its decoders on ``tu-linvit_*`` encoders,
which timm creates as linvit's own models, and trains and predicts with them at non-square sizes.

smp's DPT reads a plain ViT: ``tu-linvit_*``, timm's block maps at the patch stride. Its UPerNet (and every smp
decoder for hierarchical backbones) accepts only encoders whose levels have strides 4, 8, 16, 32, and refuses every
plain ViT, timm's own included ("Unsupported model downsampling pattern"): ``tu-linvit_*.pyramid``, the tag whose
``features_only`` model is linvit's simple feature pyramid (``linvit.models.PyramidFeatureNet``), is that encoder.
tests/models/test_feature_net.py checks the pyramid encoder without smp."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import linvit

smp = pytest.importorskip('segmentation_models_pytorch', reason='the dev extra: pip install -e .[dev]')

#: even patch grids (smp's DPT fusion upsamples by 2) whose sides the pyramid's coarsest stride, 32, divides
SIZES = ((64, 96), (128, 64))


def _check_trains_and_predicts(model: nn.Module, vit: nn.Module) -> None:
    """One SGD step of ``model`` (3 classes) on random masks is finite and changes the attention weights of ``vit``,
    its encoder's ViT; in eval mode it gives logits [1, 3, H, W] at every size of ``SIZES``."""
    assert all(isinstance(block.attn, linvit.layers.LinearAttention) for block in vit.blocks)
    images, masks = torch.randn(2, 3, *SIZES[0]), torch.randint(0, 3, (2, *SIZES[0]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = vit.blocks[0].attn.qkv.weight.detach().clone()
    loss = F.cross_entropy(model(images), masks)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and not torch.equal(vit.blocks[0].attn.qkv.weight, before)  # the encoder trains
    model.eval()
    with torch.no_grad():
        for height, width in SIZES:
            out = model(torch.randn(1, 3, height, width))
            assert out.shape == (1, 3, height, width) and torch.isfinite(out).all()


def test_smp_dpt_on_a_linvit_encoder_trains_and_predicts_at_non_square_sizes():
    torch.manual_seed(0)
    model = smp.DPT(encoder_name='tu-linvit_tiny_patch16_224', encoder_weights=None, classes=3,
                    dynamic_img_size=True, decoder_intermediate_channels=(32, 64, 96, 128), decoder_fusion_channels=32)
    encoder = model.encoder.model
    assert isinstance(encoder, linvit.LinearVisionTransformer)
    _check_trains_and_predicts(model, encoder)


def test_smp_upernet_on_the_pyramid_encoder_trains_and_predicts_at_non_square_sizes():
    torch.manual_seed(0)
    model = smp.UPerNet(encoder_name='tu-linvit_tiny_patch16_224.pyramid', encoder_weights=None, classes=3,
                        decoder_channels=32, dynamic_img_size=True, neck_dim=32)
    encoder = model.encoder.model
    assert isinstance(encoder, linvit.models.PyramidFeatureNet)
    assert encoder.feature_info.reduction() == [4, 8, 16, 32] and model.encoder.out_channels == [3, 0, 32, 32, 32, 32]
    _check_trains_and_predicts(model, encoder.backbone)
