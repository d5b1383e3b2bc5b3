"""tools/make_fmnist_hires.py, the command line over linvit.data.fmnist_hires (tested in tests/data): help with
defaults, argument checks and defaults per task, the old --task names, and runs of the script on tiny IDX files
written here (no Debian package needed): exit status, files, and the one-line errors."""
import runpy
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from linvit.data.fmnist_hires import CLASS_NAMES

pytestmark = pytest.mark.integration  # trains or starts interpreters

TOOL = Path(__file__).resolve().parents[2] / 'tools' / 'make_fmnist_hires.py'


@pytest.fixture(scope='module')
def tool():
    """The script's functions (build_parser, parse_args, main), run as a file the way python runs it."""
    return SimpleNamespace(**runpy.run_path(str(TOOL)))


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def write_fake_fmnist(folder: Path, per_class: int) -> None:
    """Train and t10k IDX files (not gzipped) with ``per_class`` solid squares of each of the 10 classes."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = np.repeat(np.arange(10, dtype=np.uint8), per_class)
    images = np.zeros((len(labels), 28, 28), dtype=np.uint8)
    images[:, 6:22, 6:22] = 200
    for prefix in ('train', 't10k'):
        for stem, array in ((f'{prefix}-images-idx3-ubyte', images), (f'{prefix}-labels-idx1-ubyte', labels)):
            header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f'>{array.ndim}I', *array.shape)
            (folder / stem).write_bytes(header + array.tobytes())


def test_every_option_has_help_with_its_default(tool):
    parser = tool.build_parser()
    for action in parser._actions[1:]:                         # [0] is --help
        shown = parser.formatter_class('make_fmnist_hires')._get_help_string(action)
        assert action.help and (action.default is None or '(default: ' in shown), action.option_strings
    assert 'dataset-fashion-mnist' in parser.format_help()


def test_defaults_per_task_and_argument_checks(tool):
    assert tool.parse_args(['--out', 'x', '--task', 'segmentation']).img_size == 1024
    assert tool.parse_args(['--out', 'x']).img_size == 512
    args = tool.parse_args(['--out', 'x', '--task', 'segmentation'])
    assert (args.train_images, args.val_images, args.items_per_image) == (2000, 200, [3, 8])
    assert tool.spec_of(tool.parse_args(['--out', 'x'])).fragments is None
    assert tool.spec_of(tool.parse_args(['--out', 'x', '--fragments', '0'])).fragments == 0
    for bad in (['--items-per-image', '0', '3'], ['--items-per-image', '5', '3'], ['--train-images', '0'],
                ['--img-size', '32'], ['--seed', '-1'], ['--task', 'detection'], ['--fragments', '-1']):
        with pytest.raises(SystemExit):
            tool.parse_args(['--out', 'x', '--task', 'segmentation', *bad])


def test_missing_idx_files_say_how_to_install(tool, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(['--out', str(tmp_path / 'out'), '--idx-dir', str(tmp_path / 'none'), '--img-size', '64'])
    message = str(exit_info.value.code)
    assert 'sudo apt-get install dataset-fashion-mnist' in message and '--idx-dir' in message
    assert str(tmp_path / 'none') in message


def test_errors_end_in_one_line_before_anything_is_written(tool, tmp_path):
    write_fake_fmnist(tmp_path / 'idx', per_class=1)
    with pytest.raises(SystemExit, match='has 1 items, fewer than the 2 asked for'):
        tool.main(['--out', str(tmp_path / 'out'), '--idx-dir', str(tmp_path / 'idx'), '--img-size', '64',
                   '--train-per-class', '2'])
    assert not (tmp_path / 'out').exists()                     # checked before anything is written
    (tmp_path / 'out').mkdir()
    (tmp_path / 'out' / 'old.png').write_bytes(b'')
    with pytest.raises(SystemExit, match='not empty'):
        tool.main(['--out', str(tmp_path / 'out'), '--idx-dir', str(tmp_path / 'idx'), '--img-size', '64'])


def test_the_script_writes_a_segmentation_set(tmp_path):
    idx_dir, out = tmp_path / 'idx', tmp_path / 'out'
    write_fake_fmnist(idx_dir, per_class=2)
    done = run_script('--task', 'segmentation', '--out', str(out), '--idx-dir', str(idx_dir), '--img-size', '64',
                      '--train-images', '2', '--val-images', '1', '--workers', '1')
    assert done.returncode == 0, done.stderr
    assert f'data.root={out}' in done.stdout.splitlines()[-1]
    assert (out / 'classes.txt').read_text().splitlines() == ['background', *CLASS_NAMES]
    assert len(list((out / 'train' / 'masks').glob('*.png'))) == 2 and (out / 'manifest.csv').is_file()
