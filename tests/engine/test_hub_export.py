"""linvit.engine.hub and tools/export_hub.py: a trained run as a timm / Hugging Face folder that
timm.create_model('local-dir:...') loads with the run's outputs; config.json and the model card checked against the
run's own files; the upload through huggingface_hub's HfApi (monkeypatched: no network); one-line refusals."""
import importlib.util
import json
import os
from pathlib import Path

import huggingface_hub
import pytest
import timm
import torch
import yaml
from huggingface_hub.errors import OfflineModeIsEnabled
from safetensors.torch import load_file
from tiny_run import TEACHER_MODEL, TINY_MODEL, TINY_RUN

import linvit
from linvit.engine import RunDir, load_config, train
from linvit.engine import hub as hub_module
from linvit.engine.checkpoint import load_checkpoint
from linvit.engine.hub import HubExportError, HubPushError, export_hub_folder, push_hub_folder

pytestmark = pytest.mark.integration  # trains or starts interpreters

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / 'tools' / 'export_hub.py'
#: the tiny run's model, written out by hand from TINY_MODEL / TINY_RUN (not read from the run)
TINY_KWARGS = dict(depth=2, embed_dim=48, num_heads=3, patch_size=8, img_size=32)


@pytest.fixture(scope='module')
def cls_run(tmp_path_factory, shared_run):
    """A finished tiny classification run with EMA weights (model.safetensors holds the EMA, not the raw model)."""
    return shared_run('cls_ema', tmp_path_factory.mktemp('hub_cls') / 'run')


@pytest.fixture(scope='module')
def cls_export(cls_run, tmp_path_factory):
    out = tmp_path_factory.mktemp('hub_out') / 'linvit-tiny'
    return export_hub_folder(str(cls_run), str(out)), out


@pytest.fixture(scope='module')
def lin_run(tmp_path_factory, shared_run):
    """A tiny softmax ViT teacher and its linearization (hedgehog feature map), both trained through train()."""
    base = tmp_path_factory.mktemp('hub_lin')
    shared_run('teacher', base / 'teacher')
    train(load_config(None, [*TINY_RUN, 'task=linearize', f'linearize.teacher={base / "teacher"}',
                             f'output_dir={base / "lin"}', 'linearize.speed=false', 'train.epochs=1']))
    return base / 'lin'


def _class_names(run):
    return [str(name) for name in load_checkpoint(run / RunDir.BEST)['class_names']]


def _images():
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _run_model(run):
    """The run's classifier built by hand from the tiny settings, with the run's model.safetensors."""
    model = timm.create_model('linvit_tiny_patch16_224', num_classes=len(_class_names(run)), **TINY_KWARGS)
    model.load_state_dict(load_file(run / RunDir.WEIGHTS))
    return model.eval()


def _front_matter(card):
    head, matter, body = card.split('---\n', 2)
    assert head == ''
    return yaml.safe_load(matter), matter, body


def _load_tool():
    spec = importlib.util.spec_from_file_location('export_hub', TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recorded_hub_calls(monkeypatch):
    """HfApi's create_repo and upload_folder replaced by recorders (no network); a token in the environment."""
    calls = {}

    class Repo:
        repo_id = 'someone/linvit-tiny'

    class Commit:
        commit_url = 'https://huggingface.co/someone/linvit-tiny/commit/abc'

    def create_repo(self, repo_id, **kwargs):
        calls['create_repo'] = dict(repo_id=repo_id, token=self.token, **kwargs)
        return Repo()

    def upload_folder(self, **kwargs):
        calls['upload_folder'] = dict(kwargs, files=sorted(os.listdir(kwargs['folder_path'])))
        return Commit()

    monkeypatch.setenv('HF_TOKEN', 'hf_test_token')
    monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, 'upload_folder', upload_folder)
    return calls


# ---------------------------------------------------------------------------------------------------- the folder

def test_timm_loads_the_folder_with_the_runs_outputs(cls_run, cls_export):
    export, out = cls_export
    assert sorted(os.listdir(out)) == ['README.md', 'config.json', 'model.safetensors']
    loaded = timm.create_model(f'local-dir:{out}', pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(_images()), _run_model(cls_run)(_images()), rtol=0, atol=0)
    assert export.max_abs_difference == 0.0 and export.model_name == f'local-dir:{out}'


def test_config_json_describes_the_run(cls_run, cls_export):
    _, out = cls_export
    config = json.loads((out / 'config.json').read_text())
    run_config = yaml.safe_load((cls_run / RunDir.CONFIG).read_text())
    names = _class_names(cls_run)
    assert config['architecture'] == run_config['model']['name'] == 'linvit_tiny_patch16_224'
    assert config['num_classes'] == len(names) and config['label_names'] == names
    assert config['model_args'].items() >= {**run_config['model']['kwargs'], 'num_classes': len(names)}.items()
    assert config['model_args']['img_size'] == [run_config['data']['img_size']] * 2
    pretrained = config['pretrained_cfg']
    source = timm.models.get_pretrained_cfg(run_config['model']['name'])
    assert pretrained['mean'] == list(source.mean) and pretrained['std'] == list(source.std)
    assert pretrained['input_size'] == [3, 32, 32] and pretrained['crop_pct'] == 1.0
    assert pretrained['interpolation'] == 'bilinear' and pretrained['crop_mode'] == 'squash'
    assert pretrained.get('license') is None  # the weights' owner sets it (not the architecture's code license)
    # what timm users read off the loaded model
    loaded = timm.create_model(f'local-dir:{out}', pretrained=True)
    assert loaded.pretrained_cfg['label_names'] == names
    data = timm.data.resolve_data_config({}, model=loaded)
    assert data['input_size'] == (3, 32, 32) and tuple(data['mean']) == tuple(source.mean)


def test_the_model_card_has_front_matter_metrics_and_the_config(cls_run, cls_export):
    _, out = cls_export
    card = (out / 'README.md').read_text()
    meta, matter, body = _front_matter(card)
    assert meta['library_name'] == 'timm' and {'timm', 'image-classification', 'linvit'} <= set(meta['tags'])
    assert 'license' not in meta and '# license:' in matter  # left for the user, commented
    metrics = json.loads((cls_run / RunDir.METRICS_JSON).read_text())
    assert metrics
    for key, value in metrics.items():
        shown = f'{value:.4f}' if isinstance(value, float) else str(value)
        assert f'| {key} | {shown} |' in body, key
    assert f"timm.create_model('local-dir:{out}', pretrained=True)" in body
    assert (cls_run / RunDir.CONFIG).read_text().strip() in body
    assert '| model.name | `linvit_tiny_patch16_224` |' in body


def test_an_export_replaces_an_earlier_one_but_never_other_files(cls_run, cls_export, tmp_path):
    _, out = cls_export
    export_hub_folder(str(cls_run), str(out))  # an earlier export: replaced
    busy = tmp_path / 'busy'
    busy.mkdir()
    (busy / 'notes.txt').write_text('mine')
    with pytest.raises(HubExportError, match=r'holds files a hub export does not write \(notes.txt\)') as error:
        export_hub_folder(str(cls_run), str(busy))
    assert '\n' not in str(error.value) and os.listdir(busy) == ['notes.txt']


# ---------------------------------------------------------------------------------------------------- linearization

def test_a_linearized_run_exports_as_the_equal_linvit_model(lin_run, tmp_path):
    export = export_hub_folder(str(lin_run), str(tmp_path / 'lin_hub'))
    config = json.loads((tmp_path / 'lin_hub' / 'config.json').read_text())
    assert config['architecture'] == 'linvit_tiny_patch16_224' and export.converted_from == 'vit_tiny_patch16_224'
    assert config['model_args']['feature_map'] == 'hedgehog' and config['model_args']['local_mix'] is False
    # the run's model, rebuilt by hand: the teacher's ViT converted as the linearization's config says
    converted = timm.create_model('vit_tiny_patch16_224', num_classes=len(_class_names(lin_run / 'stage2')),
                                  **TINY_KWARGS)
    linvit.convert_to_linear(converted, feature_map='hedgehog')
    converted.load_state_dict(load_file(lin_run / RunDir.WEIGHTS))
    loaded = timm.create_model(f'local-dir:{tmp_path / "lin_hub"}', pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(_images()), converted.eval()(_images()), rtol=0, atol=0)
    assert 'linearized from the softmax ViT `vit_tiny_patch16_224`' in (tmp_path / 'lin_hub' / 'README.md').read_text()


def _converted_by_hand(name, run, num_classes, **kwargs):
    """timm's ``name`` with the tiny kwargs, converted with a hedgehog map, the run's weights loaded strictly."""
    model = linvit.convert_to_linear(timm.create_model(name, num_classes=num_classes, **TINY_KWARGS, **kwargs),
                                     feature_map='hedgehog')
    model.load_state_dict(load_file(run / RunDir.WEIGHTS))
    return model.eval()


def test_a_conversion_no_linvit_model_rebuilds_exports_as_converted_to_linear(lin_run, tmp_path, monkeypatch):
    # a ViT shape linvit_* cannot take: its tensors differ (3 blocks for 2), so the linvit_* twin is not used
    monkeypatch.setattr(hub_module, '_VIT_SHAPE', {**hub_module._VIT_SHAPE, 'depth': lambda model: 3})
    export = export_hub_folder(str(lin_run), str(tmp_path / 'generic'))
    config = json.loads((tmp_path / 'generic' / 'config.json').read_text())
    assert config['architecture'] == 'converted_to_linear' and export.converted_from == 'vit_tiny_patch16_224'
    assert config['model_args']['base'] == 'vit_tiny_patch16_224'
    assert config['model_args']['convert'] == {'local_mix': False, 'feature_map': 'hedgehog'}
    loaded = timm.create_model(f'local-dir:{tmp_path / "generic"}', pretrained=True).eval()
    expected = _converted_by_hand('vit_tiny_patch16_224', lin_run, len(_class_names(lin_run / 'stage2')))
    with torch.no_grad():
        torch.testing.assert_close(loaded(_images()), expected(_images()), rtol=0, atol=0)


def test_a_linearized_rope_run_exports_and_loads_with_its_outputs(tmp_path):
    """A DINOv3-layout teacher (rotary embeddings, registers, layer scale) linearized: no linvit_* model has its
    layout, so the folder names converted_to_linear; timm loads it with the outputs of the run's model rebuilt by
    hand (timm's model converted, the run's weights)."""
    rope = ['model.name=vit_small_patch16_dinov3', 'model.kwargs.depth=2', 'model.kwargs.embed_dim=48',
            'model.kwargs.num_heads=3', 'model.kwargs.patch_size=8']
    train(load_config(None, [*rope, *TINY_RUN, 'train.epochs=1', f'output_dir={tmp_path / "teacher"}']))
    train(load_config(None, [*TINY_RUN, 'task=linearize', f'linearize.teacher={tmp_path / "teacher"}',
                             f'output_dir={tmp_path / "lin"}', 'linearize.speed=false', 'train.epochs=1']))
    export = export_hub_folder(str(tmp_path / 'lin'))
    assert export.architecture == 'converted_to_linear' and export.converted_from == 'vit_small_patch16_dinov3'
    loaded = timm.create_model(f'local-dir:{tmp_path / "lin" / RunDir.HUB}', pretrained=True).eval()
    assert type(loaded.blocks[0].attn).__name__ == 'EvaLinearAttention'
    expected = _converted_by_hand('vit_small_patch16_dinov3', tmp_path / 'lin',
                                  len(_class_names(tmp_path / 'lin' / 'stage2')))
    with torch.no_grad():
        torch.testing.assert_close(loaded(_images()), expected(_images()), rtol=0, atol=0)


def test_a_run_with_model_convert_exports_with_its_own_conversion(tmp_path):
    """A classifier trained as a converted timm ViT (model.convert: elu1, no learnable map) exports with those
    options, not the linearization's default (hedgehog), and loads with the run's outputs."""
    run = tmp_path / 'run'
    train(load_config(None, [*TEACHER_MODEL, *TINY_RUN, 'model.convert={}', 'train.epochs=1', f'output_dir={run}']))
    export = export_hub_folder(str(run))
    # the conversion's map by name: linvit_tiny_patch16_224 alone would build the models' default (relu)
    assert export.architecture == 'linvit_tiny_patch16_224' and export.model_args['feature_map'] == 'elu1'
    expected = linvit.convert_to_linear(timm.create_model('vit_tiny_patch16_224', num_classes=len(_class_names(run)),
                                                          **TINY_KWARGS))
    expected.load_state_dict(load_file(run / RunDir.WEIGHTS))
    loaded = timm.create_model(f'local-dir:{run / RunDir.HUB}', pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(_images()), expected.eval()(_images()), rtol=0, atol=0)


def test_a_folder_whose_model_differs_from_the_run_is_never_written(lin_run, tmp_path, monkeypatch):
    # same tensors, other outputs: average pooling instead of the class token
    monkeypatch.setattr(hub_module, '_VIT_SHAPE', {**hub_module._VIT_SHAPE, 'global_pool': lambda model: 'avg'})
    with pytest.raises(HubExportError, match="does not rebuild the run's model") as error:
        export_hub_folder(str(lin_run), str(tmp_path / 'differs'))
    assert '\n' not in str(error.value)
    assert not (tmp_path / 'differs').exists() and not [p for p in os.listdir(tmp_path) if p.startswith('.hub-')]


# ---------------------------------------------------------------------------------------------------- refusals

def test_a_segmentation_run_is_refused_in_one_line(tmp_path, shared_run):
    run = shared_run('seg', tmp_path / 'seg')
    with pytest.raises(HubExportError, match='is not a timm model') as error:
        export_hub_folder(str(run))
    message = str(error.value)
    assert '\n' not in message and 'segmentation' in message and f'tools/export_onnx.py {run}' in message
    assert not (run / RunDir.HUB).exists()


def test_an_autoregressive_run_is_refused_in_one_line(tmp_path):
    run = tmp_path / 'ar'
    train(load_config(None, [*TINY_MODEL, *TINY_RUN, 'task=autoregressive', 'data.aug.hflip=0', 'train.epochs=1',
                             'train.max_steps=2', f'output_dir={run}']))
    with pytest.raises(HubExportError, match='autoregressive run is not an image classifier') as error:
        export_hub_folder(str(run))
    assert '\n' not in str(error.value) and 'one label per image' in str(error.value)


def test_the_tool_names_what_is_not_a_run_in_one_line(tmp_path, capsys):
    tool = _load_tool()
    (tmp_path / 'empty').mkdir()
    assert tool.main([str(tmp_path / 'empty')]) == tool.EXIT_EXPORT
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'is not a linvit run directory' in err
    assert tool.main([str(tmp_path / 'missing')]) == tool.EXIT_EXPORT
    assert 'does not exist' in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- the tool

def test_the_tool_writes_the_hub_folder_inside_the_run(cls_run, capsys):
    assert _load_tool().main([str(cls_run)]) == 0
    result = capsys.readouterr()
    hub = cls_run / RunDir.HUB
    assert sorted(os.listdir(hub)) == ['README.md', 'config.json', 'model.safetensors']
    assert f"local-dir:{hub}" in result.out
    assert torch.equal(load_file(hub / 'model.safetensors')['head.weight'], load_file(cls_run / RunDir.WEIGHTS)[
        'head.weight'])


def test_push_uploads_the_folder_with_hfapi(cls_export, recorded_hub_calls):
    export, out = cls_export
    url = push_hub_folder(str(out), 'someone/linvit-tiny', private=True)
    assert url == 'https://huggingface.co/someone/linvit-tiny/commit/abc'
    assert recorded_hub_calls['create_repo'] == dict(repo_id='someone/linvit-tiny', token='hf_test_token',
                                                     private=True, exist_ok=True)
    upload = recorded_hub_calls['upload_folder']
    assert upload['repo_id'] == 'someone/linvit-tiny' and upload['folder_path'] == str(out)
    assert upload['files'] == ['README.md', 'config.json', 'model.safetensors']


def test_the_tool_pushes_with_a_card_that_loads_from_the_hub(cls_run, tmp_path, recorded_hub_calls, capsys):
    tool = _load_tool()
    out = tmp_path / 'pushed'
    assert tool.main([str(cls_run), '--out', str(out), '--push', 'someone/linvit-tiny']) == 0
    assert recorded_hub_calls['create_repo']['private'] is False
    assert recorded_hub_calls['upload_folder']['folder_path'] == str(out)
    assert "timm.create_model('hf-hub:someone/linvit-tiny', pretrained=True)" in (out / 'README.md').read_text()
    assert 'pushed to someone/linvit-tiny' in capsys.readouterr().out


def test_push_without_a_token_fails_in_one_line_naming_the_repo(cls_export, monkeypatch):
    _, out = cls_export
    monkeypatch.setattr(huggingface_hub, 'get_token', lambda: None)
    monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', lambda *a, **k: pytest.fail('no token: no call'))
    with pytest.raises(HubPushError, match='pushing to someone/linvit-tiny needs a Hugging Face token') as error:
        push_hub_folder(str(out), 'someone/linvit-tiny')
    assert '\n' not in str(error.value) and 'HF_TOKEN' in str(error.value) and 'hf auth login' in str(error.value)


def test_push_without_network_fails_in_one_line_naming_the_repo(cls_run, tmp_path, monkeypatch, capsys):
    def offline(self, repo_id, **kwargs):
        raise OfflineModeIsEnabled('Cannot reach https://huggingface.co/api/repos/create: offline mode is enabled.')

    monkeypatch.setenv('HF_TOKEN', 'hf_test_token')
    monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', offline)
    tool = _load_tool()
    out = tmp_path / 'offline'
    assert tool.main([str(cls_run), '--out', str(out), '--push', 'someone/linvit-tiny']) == tool.EXIT_PUSH
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'could not push' in err and 'someone/linvit-tiny' in err and 'HF_TOKEN' in err
    assert (out / 'model.safetensors').is_file()  # the folder stays, to push later
