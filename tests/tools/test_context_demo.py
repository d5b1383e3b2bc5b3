"""tools/context_demo.py on tiny trained runs. Shapes (segmentation): both ways printed, the pictures written, and its
whole-image mIoU equal to the one train.py's own evaluation wrote (seg.eval.mode=whole), an independent path. Depth:
the tool trains the demo's config itself, and its AbsRel, RMSE and delta1 of the whole images, of the windows and of
the training set's mean depth equal the ones computed here with numpy from the model rebuilt by hand (exp of its
output on each whole image, of its output averaged over the windows, of the mean everywhere)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_run import TINY_MODEL

from linvit.data.depth import build_depth_datasets
from linvit.engine import load_config
from linvit.engine.tasks import normalization_of
from linvit.engine.tasks.segmentation import create_segmentation_model

pytestmark = [pytest.mark.compiler, pytest.mark.integration]  # integration: trains or starts interpreters

DEPTH_CONFIG = Path(__file__).resolve().parents[2] / 'configs' / 'depth_demo.yaml'
#: the depth demo's config in 2 steps: a 2-block linvit at 32 px, 4 training and 3 validation scenes
TINY_DEPTH = [*TINY_MODEL, 'data.img_size=32', 'data.batch_size=2', 'data.num_workers=0',
              'data.synthetic.train_size=4', 'data.synthetic.val_size=3', 'seg.neck_dim=16', 'seg.head_dim=16',
              'train.epochs=1', 'train.warmup_epochs=0', 'train.log_every=1', 'train.pictures=false', 'device=cpu']
#: the tool's default windows at 32 px with 8 px patches: half the side, every quarter side
WINDOW, STRIDE = 16, 8
DEPTH_ROW = re.compile(r'^\s+(.+?)\s+AbsRel (\d+\.\d{3})  RMSE (\d+\.\d{2}) m  delta1 (\d\.\d{3})$', re.MULTILINE)


def test_whole_and_windows_are_scored_and_drawn(seg_run, context_demo_tool, capsys):
    assert context_demo_tool.main(['--run', str(seg_run), '--pictures', '2']) == 0
    printed = capsys.readouterr().out
    found = dict(re.findall(r'^\s+(whole image|sliding windows of 16 px every 8 px)\s+mIoU (\d\.\d{3})', printed,
                            re.MULTILINE))
    assert set(found) == {'whole image', 'sliding windows of 16 px every 8 px'}
    miou = json.loads((seg_run / 'metrics.json').read_text())['miou']
    assert float(found['whole image']) == pytest.approx(miou, abs=5e-4)
    for name in ('context_whole.png', 'context_windows.png'):
        assert (seg_run / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def _scores(predictions, truths) -> dict:
    """AbsRel, RMSE and delta1 of each image over its valid pixels (depth > 0: the sky has none), then the mean over
    images, written out."""
    rows = []
    for predicted, truth in zip(predictions, truths):
        valid = truth > 0
        p, t = predicted[valid].astype(np.float64), truth[valid].astype(np.float64)
        rows.append([np.mean(np.abs(p - t) / t), np.sqrt(np.mean((p - t) ** 2)),
                     np.mean(np.maximum(p / t, t / p) < 1.25)])
    return dict(zip(('abs_rel', 'rmse', 'delta1'), np.mean(rows, axis=0)))


def _windows_output(model, image: torch.Tensor) -> torch.Tensor:
    """The model's output [H, W] on WINDOW px windows every STRIDE px (the last at the edge), averaged per pixel
    over the windows that hold it."""
    side = image.shape[-1]
    starts = sorted({min(start, side - WINDOW) for start in range(0, side, STRIDE)})
    total, count = torch.zeros(side, side), torch.zeros(side, side)
    for y in starts:
        for x in starts:
            total[y:y + WINDOW, x:x + WINDOW] += model(image[None, :, y:y + WINDOW, x:x + WINDOW])[0, 0]
            count[y:y + WINDOW, x:x + WINDOW] += 1
    return total / count


def _expected_depth_scores(run: Path) -> dict:
    """{row name: scores} of the run's model rebuilt from config.yaml and model.safetensors on its validation
    scenes, and of the mean depth of its training scenes' valid pixels everywhere."""
    cfg = load_config(str(run / 'config.yaml'), [])
    model = create_segmentation_model(cfg.model, cfg.seg, 1, cfg.data.img_size).eval()
    model.load_state_dict(load_file(str(run / 'model.safetensors')))
    train, val, _ = build_depth_datasets(cfg.data, *normalization_of(cfg.model.name))
    samples = [val[i] for i in range(len(val))]
    truths = [depth.numpy() for _, depth in samples]
    with torch.no_grad():
        whole = [model(image[None])[0, 0].exp().numpy() for image, _ in samples]
        windows = [_windows_output(model, image).exp().numpy() for image, _ in samples]
    training_depths = np.concatenate([train.render(i)[1].ravel() for i in range(len(train))])
    mean = training_depths[training_depths > 0].astype(np.float64).mean()
    return {'whole image': _scores(whole, truths),
            f'sliding windows of {WINDOW} px every {STRIDE} px': _scores(windows, truths),
            f"the training set's mean depth ({mean:.2f} m) everywhere": _scores([np.full_like(t, mean) for t in truths],
                                                                                truths)}


def test_a_depth_run_is_trained_then_scored_whole_in_windows_and_by_its_mean_depth(tmp_path, context_demo_tool,
                                                                                   capsys):
    run = tmp_path / 'depth'
    assert context_demo_tool.main(['--config', str(DEPTH_CONFIG), '--out', str(run), '--pictures', '2',
                                   *TINY_DEPTH]) == 0
    printed = capsys.readouterr().out
    found = {name: dict(zip(('abs_rel', 'rmse', 'delta1'), map(float, values)))
             for name, *values in DEPTH_ROW.findall(printed)}
    expected = _expected_depth_scores(run)
    assert set(found) == set(expected), printed
    for name, scores in expected.items():
        for metric, value in scores.items():
            printed_digits = 2 if metric == 'rmse' else 3
            assert found[name][metric] == pytest.approx(value, abs=0.5 * 10 ** -printed_digits + 1e-5), (name, metric)
    whole = expected['whole image']['abs_rel']
    windows = expected[f'sliding windows of {WINDOW} px every {STRIDE} px']['abs_rel']
    if abs(whole - windows) > 1e-3:  # printed to 3 digits: a closer pair may print as a tie
        better = 'whole image beats sliding windows' if whole < windows else 'sliding windows beat the whole image'
        assert f'\n{better} on AbsRel: ' in printed, printed
    # train.py's own evaluation of the same weights (seg.eval.mode=whole), written to metrics.json
    assert json.loads((run / 'metrics.json').read_text())['abs_rel'] == pytest.approx(whole, rel=1e-4)
    for name in ('context_whole.png', 'context_windows.png'):
        assert (run / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
