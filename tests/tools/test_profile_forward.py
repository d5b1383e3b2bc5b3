"""tools/profile_forward.py: a preset of profile_resolution.py (one size, eager, batch 1) whose failures are shown."""
import csv


def test_preset_is_linvit_vs_vit_small_with_floors_at_one_size_eager_batch_1(prof, forward):
    args = prof.parse_args(forward.preset_argv('768x1280', 1, 3, '/tmp/out', []))
    assert args.models == ['linvit_small_patch16_512', 'linvit_small_patch16_512:local_mix=False',
                           'vit_small_patch16_224']
    assert (args.floors, args.sizes, args.mode, args.dtype, args.batch, args.task) == (
        'linear', [(768, 1280)], ['eager'], ['fp32'], [1], ['infer'])
    assert (args.warmup, args.repeats, args.out) == (1, 3, '/tmp/out')
    # options of profile_resolution.py come last and override the preset
    passed_on = prof.parse_args(forward.preset_argv('1024', 1, 3, '/tmp/out', ['--floors', 'none', '--threads', '2']))
    assert (passed_on.floors, passed_on.threads) == ('none', 2)


def _in_process(prof):
    """run_config without a subprocess: the same result fields, measured (or failing) in this process."""
    def run_config(config, timeout, retain_freed_memory=False):
        return {**prof.base_row(config), **prof.child_result(config)}
    return run_config


def test_a_size_the_patch_does_not_divide_fails_with_the_models_message(prof, forward, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.setattr(forward, 'load_profile_resolution', lambda: prof)
    monkeypatch.setattr(prof, 'run_config', _in_process(prof))
    status = forward.main(['--size', '200', '--repeats', '1', '--out', str(tmp_path),
                           '--models', 'linvit_small_patch16_512:depth=1', '--floors', 'none'])
    printed = capsys.readouterr().out
    assert status == 1
    failed = printed.split('# 1 of 1 configurations failed:')[1].strip()
    assert failed.startswith('linvit_small_patch16_512:depth=1 200 b1 fp32 eager infer: ERROR ValueError: image size '
                             '200x200 is not divisible by the patch size 16x16')
    [row] = csv.DictReader((tmp_path / 'profile.csv').open())
    assert row['status'] == 'error' and row['error'].startswith('ValueError: image size 200x200')
