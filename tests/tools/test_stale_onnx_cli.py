"""An ONNX file exported from a run is tied to the weights it came from (issue 48): tools/export_onnx.py records the
weights file's absolute path and sha256, and tools/predict.py refuses the file in one line once those weights have
changed (the run trained again, or rewritten), uses it while they are unchanged and when they are gone."""
import hashlib
import shutil

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file, save_file

from linvit.export import read_metadata

pytestmark = [pytest.mark.compiler, pytest.mark.integration]  # integration: trains or starts interpreters


def _image(path, height: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rewrite_weights(path):
    """What another training into the same run does to model.safetensors: other values, same keys and shapes."""
    weights = load_file(path)
    weights['head.bias'] = weights['head.bias'] + 1.0
    save_file(weights, path)


def test_predict_refuses_an_onnx_file_whose_weights_changed(export_tool, predict_tool, shared_run, tmp_path, capsys):
    run = shared_run('cls', tmp_path / 'run')   # this test's own copy of the session's run: its weights change here
    onnx_path = tmp_path / 'elsewhere' / 'cls.onnx'   # --out: a file that --overwrite of the run cannot see
    onnx_path.parent.mkdir()
    weights = run / 'model.safetensors'
    # the export as the refusal below will tell the user to run it again (one export: each costs seconds of tracing)
    exported_by = [str(weights.resolve()), '--out', str(onnx_path)]
    assert export_tool.main(exported_by) == 0
    meta = read_metadata(onnx_path)
    assert meta['weights'] == str(weights.resolve()) and meta['weights_sha256'] == _sha256(weights)
    image = _image(tmp_path / 'photo.png', 40, 50)
    assert predict_tool.main([str(onnx_path), str(image)]) == 0   # unchanged weights: predicted

    _rewrite_weights(weights)
    capsys.readouterr()
    assert predict_tool.main([str(onnx_path), str(image)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    assert str(onnx_path) in lines[0] and str(weights.resolve()) in lines[0]
    assert 'has changed since the export' in lines[0]
    # the command the message gives is the export that made a file bound to the weights it read (above)
    assert lines[0].split('python tools/export_onnx.py ')[1].split() == exported_by

    shutil.rmtree(run)   # the weights are gone: the file stands alone
    assert predict_tool.main([str(onnx_path), str(image)]) == 0

