"""model.pretrained=true: timm's weights of model.name (a pretrained tag, hf-hub:org/name, local-dir:FOLDER) through
train.py's config and the engine, offline: tiny timm ViTs saved with timm's own ``save_for_hf`` into a folder, or into
a Hugging Face cache laid out by hand and read under HF_HUB_OFFLINE=1."""
import http.server
import os
import socket
import subprocess
import sys
import threading

import pytest
import timm
import torch
from cli import run_train_py
from huggingface_hub import constants as hf_constants
from omegaconf import OmegaConf
from timm.models._hub import save_for_hf
from tiny_run import TINY_RUN, TINY_SEG

import linvit  # noqa: F401  (registers linvit_* with timm)
from linvit.engine import ConfigError, build_task, load_config
from linvit.engine.distributed import setup_distributed
from linvit.engine.hub import hub_unreachable_reason
from linvit.engine.run import build_run
from linvit.engine.tasks import base
from linvit.engine.tasks.base import create_model_from_config, normalization_of
from linvit.engine.tasks.linearize import LinearizeTask

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: a one-block, 48-wide timm ViT at 32 px with patches of 8: what the folders and the cache hold
TINY_VIT = dict(depth=1, embed_dim=48, num_heads=3, patch_size=8, img_size=32)
#: a normalisation no timm default has, so that reading it from the folder's config.json shows
MEAN, STD = (0.1, 0.2, 0.3), (0.4, 0.5, 0.6)
REPO = 'someorg/tiny-vit'
COMMIT = 'a' * 40


def _classes():
    """The class count of TINY_RUN's synthetic data (a saved head of that many rows is kept by timm)."""
    cfg = load_config(None, TINY_RUN)
    return len(build_task(cfg).build_datasets((0.5,) * 3, (0.5,) * 3, with_train=False)[2])


def _save(folder, num_classes, name='vit_tiny_patch16_224', seed=1):
    """A tiny timm model with random weights, saved as timm saves one for the hub (config.json + model.safetensors,
    the pretrained config's mean/std set to MEAN/STD); returns its state dict. Its seed is not build_run's (0):
    random weights built from the config cannot pass for loaded ones."""
    torch.manual_seed(seed)
    model = timm.create_model(name, num_classes=num_classes, **TINY_VIT)
    save_for_hf(model, folder, safe_serialization=True, model_config={'pretrained_cfg': {'mean': MEAN, 'std': STD}})
    return {key: value.clone() for key, value in model.state_dict().items()}


def _cache(cache_dir, num_classes, files=('config.json', 'model.safetensors')):
    """A Hugging Face hub cache holding REPO at COMMIT (refs/main -> snapshots/COMMIT/...), as a download leaves it;
    returns the saved state dict."""
    repo = cache_dir / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / 'snapshots' / COMMIT
    saved = _save(snapshot, num_classes)
    for name in {'config.json', 'model.safetensors'} - set(files):
        os.remove(snapshot / name)
    (repo / 'refs').mkdir()
    (repo / 'refs' / 'main').write_text(COMMIT)
    return saved


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline: the environment, and huggingface_hub's constants (read at import) as
    that environment would set them (the test's train.py runs in this process); linvit's per-process cache of hub
    configs is emptied around the test."""
    cache = tmp_path / 'hf_cache'
    cache.mkdir()
    monkeypatch.setenv('HF_HUB_CACHE', str(cache))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setattr(hf_constants, 'HF_HUB_CACHE', str(cache))
    monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', True)
    base._hub_source.cache_clear()
    yield cache
    base._hub_source.cache_clear()


def _train_py(tmp_path, *overrides):
    """train.py on TINY_RUN for one step into tmp_path/run, in this process (tests/cli.py: the environment and
    huggingface_hub's constants the test set hold); its config file sets nothing (configs/ would set the model's
    kwargs, which override the saved model's arguments, as they do for any timm model)."""
    config = tmp_path / 'empty.yaml'
    config.write_text('seed: 0\n')
    return run_train_py('--config', str(config), *TINY_RUN, 'train.max_steps=1', f'output_dir={tmp_path}/run',
                        *overrides)


def _built(*overrides):
    """The model and normalisation build_run makes of TINY_RUN with the overrides (no training)."""
    run = build_run(load_config(None, [*TINY_RUN, *overrides]), setup_distributed('cpu'), with_train=False)
    return run.model, run.mean, run.std


def _assert_same(state, saved, skip=()):
    assert set(state) == set(saved)
    for key in saved:
        if not key.startswith(skip):
            assert torch.equal(state[key], saved[key]), key


# ---------------------------------------------------------------------------------------------------- local-dir:

@pytest.mark.integration
def test_local_dir_weights_load_exactly_and_train_a_step(tmp_path):
    folder = tmp_path / 'tiny'
    saved = _save(folder, _classes())
    model, mean, std = _built(f'model.name=local-dir:{folder}', 'model.pretrained=true')
    _assert_same(model.state_dict(), saved)  # every tensor, the head included: its class count is the data's
    assert (mean, std) == (MEAN, STD)
    result = _train_py(tmp_path, f'model.name=local-dir:{folder}', 'model.pretrained=true')
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(tmp_path / 'run' / 'model.safetensors')


def test_local_dir_head_of_other_classes_is_reinitialised(tmp_path):
    folder = tmp_path / 'tiny'
    saved = _save(folder, _classes() + 3)
    model, _, _ = _built(f'model.name=local-dir:{folder}', 'model.pretrained=true')
    state = model.state_dict()
    _assert_same(state, saved, skip=('head.',))
    assert state['head.weight'].shape[0] == _classes()


def test_without_pretrained_the_folder_gives_its_architecture_only(tmp_path):
    folder = tmp_path / 'tiny'
    saved = _save(folder, _classes())
    model, _, _ = _built(f'model.name=local-dir:{folder}')
    state = model.state_dict()
    assert state['blocks.0.attn.qkv.weight'].shape == saved['blocks.0.attn.qkv.weight'].shape
    assert not torch.equal(state['blocks.0.attn.qkv.weight'], saved['blocks.0.attn.qkv.weight'])


def test_normalization_comes_from_the_folders_pretrained_config(tmp_path):
    _save(tmp_path / 'tiny', 10)
    assert normalization_of(f'local-dir:{tmp_path / "tiny"}') == (MEAN, STD)
    assert normalization_of('vit_tiny_patch16_224.augreg_in21k_ft_in1k') == ((0.5,) * 3, (0.5,) * 3)  # a tag's


def test_another_input_size_is_logged(tmp_path, caplog):
    folder = tmp_path / 'tiny'
    _save(folder, 10)
    cfg = load_config(None, [f'model.name=local-dir:{folder}', 'model.pretrained=true', 'data.img_size=64'])
    with caplog.at_level('INFO', logger='linvit.train'):
        model = create_model_from_config(cfg.model, num_classes=10, img_size=64)
    assert 'pretrained at 32 px' in caplog.text and 'data.img_size=64' in caplog.text
    assert model.patch_embed.grid_size == (8, 8)  # built for data.img_size, the position embedding resampled


def test_segmentation_backbone_loads_the_folders_weights(tmp_path):
    folder = tmp_path / 'tiny'
    saved = _save(folder, 10)
    model, _, _ = _built(*TINY_SEG, f'model.name=local-dir:{folder}', 'model.pretrained=true')
    backbone = model.backbone.state_dict()
    assert {key for key in saved if key.startswith('blocks.')} <= set(backbone)
    for key, value in backbone.items():  # the backbone has no classifier and no final norm
        assert torch.equal(value, saved[key]), key


# ---------------------------------------------------------------------------------------------------- hf-hub:

@pytest.mark.integration
def test_hf_hub_name_from_the_offline_cache_loads_and_trains(offline_cache, tmp_path):
    saved = _cache(offline_cache, _classes())
    model, mean, std = _built(f'model.name=hf-hub:{REPO}', 'model.pretrained=true')
    _assert_same(model.state_dict(), saved)
    assert (mean, std) == (MEAN, STD)
    result = _train_py(tmp_path, f'model.name=hf-hub:{REPO}', 'model.pretrained=true')
    assert result.returncode == 0, result.stderr[-3000:]
    saved_cfg = OmegaConf.load(tmp_path / 'run' / 'config.yaml')
    assert saved_cfg.model.name == f'hf-hub:{REPO}' and saved_cfg.model.pretrained


@pytest.mark.integration
def test_hf_hub_name_absent_offline_is_one_line_exit_2(offline_cache, tmp_path):
    result = _train_py(tmp_path, 'model.name=hf-hub:someorg/absent', 'model.pretrained=true')
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    for words in ('hf-hub:someorg/absent', 'HF_HUB_OFFLINE', 'model.pretrained_file=PATH', 'local-dir:'):
        assert words in last
    assert 'Traceback' not in result.stderr


def test_hf_hub_weights_missing_from_the_cache_is_one_config_error(offline_cache):
    _cache(offline_cache, 10, files=('config.json',))  # the config was fetched, the weights were not
    cfg = load_config(None, [f'model.name=hf-hub:{REPO}', 'model.pretrained=true', 'data.img_size=32'])
    with pytest.raises(ConfigError) as error:
        create_model_from_config(cfg.model, num_classes=10, img_size=32)
    message = str(error.value)
    assert '\n' not in message and f'hf-hub:{REPO}' in message and 'HF_HUB_OFFLINE=1' in message
    assert 'model.pretrained_file=PATH' in message


# ---------------------------------------------------------------------------------------------------- config errors

@pytest.mark.parametrize('overrides, words', [
    (['model.name=vit_tiny_patch16_224', 'model.pretrained=true', 'model.pretrained_file=w.safetensors'],
     ['model.pretrained=true and model.pretrained_file=', 'set one']),
    (['model.pretrained=true'], ['no pretrained weights exist', 'linvit_tiny_patch16_224', 'model.pretrained_file']),
    (['model.name=vit_tiny_patch16_224.nonexistent', 'model.pretrained=true'], ['Invalid pretrained tag']),
    (['model.kwargs.pretrained=true'], ['model.pretrained=true', 'model.pretrained_file=PATH']),
    (['model.name=local-dir:/nonexistent/folder'], ['config.json does not exist']),
    (['model.name=someorg/tiny-vit'], ['hf-hub:someorg/tiny-vit']),
])
def test_config_errors_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert '\n' not in str(error.value)
    for word in words:
        assert word in str(error.value)


def test_a_folder_without_weights_is_one_config_error(tmp_path):
    folder = tmp_path / 'tiny'
    _save(folder, 10)
    os.remove(folder / 'model.safetensors')
    cfg = load_config(None, [f'model.name=local-dir:{folder}', 'model.pretrained=true', 'data.img_size=32'])
    with pytest.raises(ConfigError, match='no pretrained weights exist for model.name=.local-dir:'):
        create_model_from_config(cfg.model, num_classes=10, img_size=32)


# ---------------------------------------------------------------------------------------------------- linearization

def _linearize(folder, stage='attention'):
    return load_config(None, [*TINY_RUN, 'task=linearize', f'model.name=local-dir:{folder}', 'model.pretrained=true',
                              f'linearize.stage={stage}'])


def test_a_pretrained_teacher_and_its_student_start_from_the_folders_weights(tmp_path):
    folder = tmp_path / 'teacher'
    saved = _save(folder, _classes())
    task = LinearizeTask(_linearize(folder, 'finetune'))
    student = task.build_model(_classes())
    _assert_same(task.teacher.state_dict(), saved)
    # the student is the teacher converted: every teacher tensor kept, the conversion's own tensors added
    state = student.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key


def test_a_pretrained_teacher_needs_the_datas_classes(tmp_path):
    folder = tmp_path / 'teacher'
    _save(folder, _classes() + 1)
    with pytest.raises(ConfigError, match='pretrained with .* classes'):
        LinearizeTask(_linearize(folder)).build_model(_classes())


def test_a_finished_pretrained_linearization_rebuilds_without_its_teacher(tmp_path):
    folder = tmp_path / 'teacher'
    _save(folder, _classes())
    cfg = load_config(None, ['model.pretrained=false'], base=OmegaConf.to_container(_linearize(folder, 'all')))
    student = LinearizeTask(cfg).build_model(_classes())  # what loading.py does with a saved config
    assert 'blocks.0.attn.qkv.weight' in student.state_dict()


# ------------------------------------------------------------------------------------------------ an unreachable hub

def _closed_port() -> int:
    """A local port nothing listens on: connecting to it is refused at once, as an unreachable Hub is."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_the_hub_check_tells_an_answering_endpoint_from_a_closed_one(monkeypatch):
    server = http.server.HTTPServer(('127.0.0.1', 0), http.server.BaseHTTPRequestHandler)  # answers 501 to HEAD
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', False)
        monkeypatch.setattr(hf_constants, 'ENDPOINT', f'http://127.0.0.1:{server.server_port}')
        assert hub_unreachable_reason() is None  # any HTTP answer: the Hub is there
    finally:
        server.shutdown()
        server.server_close()
    closed = f'http://127.0.0.1:{_closed_port()}'
    monkeypatch.setattr(hf_constants, 'ENDPOINT', closed)
    reason = hub_unreachable_reason()
    assert reason.startswith(f'the Hugging Face Hub {closed} did not answer within 3 s (ConnectError: ')
    monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', True)
    assert hub_unreachable_reason() is None  # offline: nothing is asked


@pytest.mark.integration
@pytest.mark.parametrize('name, fresh_process', [('vit_tiny_patch16_224.augreg_in21k_ft_in1k', True),
                                                 ('hf-hub:timm/vit_tiny_patch16_224', False)])
def test_pretrained_weights_from_an_unreachable_hub_fail_in_one_line_without_retries(tmp_path, monkeypatch, name,
                                                                                     fresh_process):
    """A pretrained tag in a fresh interpreter (HF_ENDPOINT and the cache as huggingface_hub reads them at import),
    an hf-hub: name in this process with huggingface_hub's constants set as that import would set them."""
    endpoint, cache = f'http://127.0.0.1:{_closed_port()}', tmp_path / 'hf_cache'
    config = tmp_path / 'empty.yaml'
    config.write_text('seed: 0\n')
    args = ['--config', str(config), *TINY_RUN, 'train.max_steps=1', f'model.name={name}', 'model.pretrained=true',
            f'output_dir={tmp_path}/run']
    if fresh_process:
        env = {key: value for key, value in os.environ.items() if key not in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE')}
        env.update(HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(cache), OMP_NUM_THREADS='1')
        result = subprocess.run([sys.executable, 'train.py', *args], cwd=ROOT, capture_output=True, text=True,
                                timeout=600, env=env)
    else:
        for key in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv('HF_HUB_CACHE', str(cache))
        monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', False)
        monkeypatch.setattr(hf_constants, 'ENDPOINT', endpoint)
        monkeypatch.setattr(hf_constants, 'HF_HUB_CACHE', str(cache))
        base._hub_source.cache_clear()
        result = run_train_py(*args)
        base._hub_source.cache_clear()
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train.py: config error: model.name={name!r}: what it needs from the Hub (config.json, "
                           f"weights) is not in the Hugging Face cache ({cache}) and the Hugging Face "
                           f"Hub {endpoint} did not answer within 3 s"), last
    assert 'model.pretrained_file=PATH' in last
    assert 'Retrying in' not in result.stderr  # huggingface_hub's backoff (about a minute) never started
    assert not (tmp_path / 'run').exists()
