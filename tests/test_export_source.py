"""What linvit.export gives tools/export_onnx.py besides the export itself: a model spec or a trained run as the
source, the check that a file's weights have not changed since the export, and the latency table's arithmetic."""
import hashlib
import logging
import re

import pytest
import torch

from linvit.export import StaleExportError, check_source_weights, format_latency, is_trained_source, load_export_source


def test_a_model_spec_source_takes_any_size_and_names_its_file():
    source = load_export_source('linvit_tiny_patch16_224:depth=1,patch_size=8,num_classes=4', img_size=(32, 48))
    assert source.img_size == (32, 48) and source.default_out == 'linvit_tiny_patch16_224.onnx'
    assert source.metadata == {'model_name': 'linvit_tiny_patch16_224',
                               'source': 'linvit_tiny_patch16_224:depth=1,patch_size=8,num_classes=4'}
    assert not source.model.training and len(source.model.blocks) == 1
    with torch.no_grad():
        assert source.model(torch.randn(1, 3, 40, 24)).shape == (1, 4)   # dynamic_img_size: any multiple of 8
    fixed = load_export_source('linvit_tiny_patch16_224:depth=1', dynamic_size=False)
    assert fixed.img_size == (224, 224) and fixed.model.patch_embed.strict_img_size


def test_trained_sources_are_told_from_model_specs(tmp_path):
    assert is_trained_source(str(tmp_path)) and is_trained_source('runs/x/best.pt')
    assert is_trained_source('model.safetensors') and not is_trained_source('linvit_small_patch16_224:depth=2')
    with pytest.raises(Exception, match='no_such_model_xyz'):
        load_export_source('no_such_model_xyz')


def test_latency_table_ratios():
    rows = [{'height': 32, 'width': 32, 'eager': 6.0, 'compiled': 3.0, 'onnxruntime': 2.0},
            {'height': 24, 'width': 40, 'eager': 1.0, 'compiled': 4.0, 'onnxruntime': 8.0}]
    lines = format_latency(rows, 'float16').splitlines()
    assert 'PyTorch float32, onnxruntime float16' in lines[0]
    assert lines[2].split() == ['32', '6.0', '3.0', '2.0', '3.00x', '1.50x']
    assert lines[3].split() == ['24x40', '1.0', '4.0', '8.0', '0.12x', '0.50x']


def test_source_weights_are_checked_only_while_they_exist(tmp_path, caplog):
    weights = tmp_path / 'model.safetensors'
    weights.write_bytes(b'x' * 3_000_000)   # more than one chunk of the fingerprint
    meta = {'weights': str(weights), 'weights_sha256': hashlib.sha256(weights.read_bytes()).hexdigest(),
            'dtype': 'float16'}
    check_source_weights('m.onnx', meta)                      # unchanged: nothing to say
    check_source_weights('m.onnx', {'model_name': 'linvit_tiny_patch16_224'})   # no weights recorded: not checked
    weights.write_bytes(b'x' * 2_999_999 + b'y')
    path = re.escape(str(weights))
    with pytest.raises(StaleExportError, match=rf"m\.onnx was exported from {path}, which has changed since the "
                                               rf"export .*: export it again with python tools/export_onnx\.py "
                                               rf"{path} --out m\.onnx --dtype float16$"):
        check_source_weights('m.onnx', meta)
    weights.unlink()
    with caplog.at_level(logging.INFO, logger='linvit.export'):
        check_source_weights('m.onnx', meta)                  # gone: the file stands alone
    assert 'are gone; using the file as it is' in caplog.text
