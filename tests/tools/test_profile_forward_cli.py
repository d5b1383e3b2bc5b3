"""tools/profile_forward.py: a preset of profile_resolution.py (one size, eager, batch 1) whose failures are shown."""
import csv

import pytest
from scripted_clock import ScriptedClock, float_cells, in_process

from linvit.bench import profile
from linvit.bench.profile_cli import parse_args


def test_preset_is_linvit_vs_vit_small_with_floors_at_one_size_eager_batch_1(forward):
    args = parse_args(forward.preset_argv(['768x1280'], 1, 3, '/tmp/out', []))
    assert args.models == ['linvit_small_patch16_512', 'linvit_small_patch16_512:local_mix=False',
                           'vit_small_patch16_224']
    assert (args.floors, args.sizes, args.mode, args.dtype, args.batch, args.workload) == (
        'linvit', [(768, 1280)], ['eager'], ['float32'], [1], ['inference'])
    assert (args.warmup, args.repeats, args.out) == (1, 3, '/tmp/out')
    # options of profile_resolution.py come last and override the preset
    passed_on = parse_args(forward.preset_argv(['1024'], 1, 3, '/tmp/out', ['--floors', 'none', '--threads', '2']))
    assert (passed_on.floors, passed_on.threads) == ('none', 2)


def test_a_size_the_patch_does_not_divide_fails_with_the_models_message(forward, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profile, 'run_config', in_process(profile))
    status = forward.main(['--sizes', '200', '--repeats', '1', '--out', str(tmp_path),
                           '--models', 'linvit_small_patch16_512:depth=1', '--floors', 'none'])
    printed = capsys.readouterr().out
    assert status == 1
    failed = printed.split('# 1 of 1 configurations failed:')[1].strip()
    assert failed.startswith('linvit_small_patch16_512:depth=1 200 b1 float32 eager inference: ERROR ValueError: image '
                             'size 200x200 is not divisible by the patch size 16x16')
    [row] = csv.DictReader((tmp_path / 'profile.csv').open())
    assert row['status'] == 'error' and row['error'].startswith('ValueError: image size 200x200')


def test_the_preset_times_one_image_per_call_at_the_given_size(forward, tmp_path, capsys, monkeypatch):
    """With a scripted clock the printed img/s and ratios are known: the preset's size, batch 1 and repeats reach
    the models (their own options replace the preset's ViT-S models to keep the test small)."""
    ms = {('linvit_tiny_patch16_224', False): 40., ('linvit_tiny_patch16_224', True): 20.,
          ('vit_tiny_patch16_224', False): 80.}
    clock = ScriptedClock(lambda name, floor, h, w, call: 1e3 if call == 0 else ms[name, floor])
    clock.install(monkeypatch, profile)
    monkeypatch.setattr(profile, 'run_config', in_process(profile))
    models = ['linvit_tiny_patch16_224:depth=1', 'vit_tiny_patch16_224:depth=1']
    assert forward.main(['--sizes', '32x48', '--repeats', '2', '--out', str(tmp_path), '--models', *models]) == 0
    assert sorted(set(clock.inputs)) == [('linvit_tiny_patch16_224', False, (1, 3, 32, 48)),
                                         ('linvit_tiny_patch16_224', True, (1, 3, 32, 48)),
                                         ('vit_tiny_patch16_224', False, (1, 3, 32, 48))]
    assert len(clock.inputs) == 3 * (1 + 2)  # one warm-up and two timed forwards per model
    table = capsys.readouterr().out.split(f"## {models[0]} vs {models[1]}")[1]
    [cells] = [line.split() for line in table.splitlines() if line.split()[:1] == ['32x48']]
    # size, tokens, img/s of linvit, floor, softmax; linvit/floor, linvit/softmax
    assert float_cells(' '.join(cells[1:]))[:6] == pytest.approx([7, 25., 50., 12.5, 0.5, 2.], abs=5e-3)
