"""tools/predict.py over a folder with a stand-in segmenter (no training): a truncated TIFF among good images is
skipped and listed at the end with exit status 1 while the images after it are predicted; Ctrl-C ends the batch
with one line and exit status 130."""
import numpy as np
import tifffile
import torch

from linvit.predict import Predictor


def red_threshold_segmenter() -> Predictor:
    """Logits [B, 2, H, W]: class 1 where the normalised red channel is positive."""
    def run(images: torch.Tensor) -> torch.Tensor:
        return torch.cat([-images[:, :1], images[:, :1]], dim=1)
    return Predictor(run=run, task='segmentation', class_names=['dark', 'red'], mean=(0.5,) * 3, std=(0.5,) * 3,
                     img_size=(16, 16), multiple=8)


def write_folder(folder, broken: str = 'b'):
    """a.tif, b.tif, c.tif (tiled RGB, 64 x 48); ``broken`` cut after 60% of its bytes (it opens, its lower tiles
    are missing)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in 'abc':
        path = folder / f'{name}.tif'
        tifffile.imwrite(path, rng.integers(0, 256, (64, 48, 3), dtype=np.uint8), photometric='rgb', tile=(16, 16),
                         compression='zlib')
        if name == broken:
            path.write_bytes(path.read_bytes()[:int(path.stat().st_size * 0.6)])


def test_a_truncated_tiff_is_skipped_listed_and_the_batch_goes_on(predict_tool, tmp_path, monkeypatch, capsys):
    write_folder(tmp_path / 'in')
    monkeypatch.setattr(predict_tool, 'load_predictor', lambda *args: red_threshold_segmenter())
    code = predict_tool.main(['run', str(tmp_path / 'in'), '--out', str(tmp_path / 'out'), '--mode', 'whole'])
    err = capsys.readouterr().err.splitlines()
    assert code == 1
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == [
        'a_mask.tif', 'a_overlay.png', 'a_preview.png', 'c_mask.tif', 'c_overlay.png', 'c_preview.png']
    broken = str(tmp_path / 'in' / 'b.tif')
    assert any(line.startswith(f'skipped {broken}: ') and 'truncated' in line for line in err)
    assert err[-1] == f'1 input(s) skipped: {broken}'


def test_ctrl_c_is_one_line_and_exit_status_130(predict_tool, tmp_path, monkeypatch, capsys):
    write_folder(tmp_path / 'in', broken='')
    predictor = red_threshold_segmenter()
    inner, calls = predictor.run, []

    def interrupted_on_the_second_image(images: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return inner(images)
    predictor.run = interrupted_on_the_second_image
    monkeypatch.setattr(predict_tool, 'load_predictor', lambda *args: predictor)
    code = predict_tool.main(['run', str(tmp_path / 'in'), '--out', str(tmp_path / 'out'), '--mode', 'whole'])
    err = capsys.readouterr().err
    assert code == 130
    assert 'Traceback' not in err
    lines = [line for line in err.splitlines() if line.startswith('interrupted')]
    assert lines == [f"interrupted: 1 of 3 image(s) written to {tmp_path / 'out'}; the image in progress left no "
                     f"files"]
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['a_mask.tif', 'a_overlay.png', 'a_preview.png']
