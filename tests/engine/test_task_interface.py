"""What a task says about itself, and that nothing else needs its name: the classifier key and logits rank against a
model the task builds, its architecture keys, a linearization's stages, a staged toy task through train(), and no
task name (or task config section) in the loop, the loading, prediction and export modules."""
import ast
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from tiny_run import TINY_MODEL, TINY_RUN, TINY_SEG

import linvit
from linvit.engine import TASKS, build_task, load_config, register_task, train
from linvit.engine.config import ARCHITECTURE_KEYS, config_schema
from linvit.engine.tasks import Stage, StagedRun, architecture_keys, predicted_tasks, task_of_logits
from linvit.engine.tasks.classification import ClassificationTask

PACKAGE = Path(linvit.__file__).resolve().parent
#: the modules that serve every task: none of them may name one
TASK_FREE = ['engine/trainer.py', 'engine/run.py', 'engine/evaluation.py', 'engine/run_log.py', 'engine/loading.py',
             'engine/commands.py', 'engine/checkpoint.py', 'engine/run_files.py', 'predict.py', 'export.py']
PREDICTING = [name for name, task in TASKS.items() if task.logits_rank]


def _tiny(name):
    return load_config(None, [*TINY_MODEL, *(TINY_SEG if name == 'segmentation' else TINY_RUN), f'task={name}'])


@pytest.mark.parametrize('name', PREDICTING)
def test_the_classifier_key_and_logits_rank_are_those_of_the_model_the_task_builds(name):
    task = build_task(_tiny(name))
    model = task.build_model(5).eval()
    assert task.classifier_key in model.state_dict() and model.state_dict()[task.classifier_key].shape[0] == 5
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).ndim == task.logits_rank
    assert task_of_logits(task.logits_rank) == name and task.inference_task() is task


def test_ranks_no_task_predicts_name_no_task_and_every_unpredicted_task_says_why():
    assert task_of_logits(3) is None and task_of_logits(0) is None
    # detection predicts boxes and depth values per pixel, not logits: predict.py takes their runs
    # (tests/tools/test_predict_detection.py, tests/test_predict_depth.py); a linearization's, as the task it linearized
    assert predicted_tasks() == ['classification', 'detection', 'segmentation', 'depth']
    assert TASKS.get('detection').predicts_boxes and TASKS.get('depth').predicts_values
    unpredicted = [name for name in TASKS.names() if name not in [*predicted_tasks(), 'linearize']]
    assert unpredicted and all(TASKS.get(name).not_predicted for name in unpredicted)


@pytest.mark.parametrize('name', TASKS.names())
def test_architecture_keys_are_config_keys(name):
    schema = config_schema()
    keys = architecture_keys(name)
    assert keys[:len(ARCHITECTURE_KEYS)] == tuple(ARCHITECTURE_KEYS)
    assert all(OmegaConf.select(schema, key, default='absent') != 'absent' for key in keys), keys
    assert architecture_keys('no_such_task') == tuple(ARCHITECTURE_KEYS)


def test_segmentation_says_how_prediction_runs_its_model():
    task = build_task(load_config(None, [*TINY_SEG, 'seg.eval.mode=slide', 'seg.eval.window=64']))
    assert task.prediction_defaults() == {'mode': 'slide', 'window': 64, 'stride': None}
    assert build_task(_tiny('classification')).prediction_defaults() == {}


def test_a_linearization_plans_its_stages_and_is_used_as_the_task_it_linearized(tmp_path):
    teacher = tmp_path / 'teacher.safetensors'  # a bare weights file: the config describes the teacher
    save_file({'w': torch.zeros(1)}, teacher)
    cfg = load_config(None, ['task=linearize', f'linearize.teacher={teacher}', 'linearize.task=segmentation',
                             f'output_dir={tmp_path / "lin"}'])
    task = build_task(cfg)
    staged = task.staged_run()
    assert [stage.folder for stage in staged.stages] == ['stage1', 'stage2']
    first, second = (stage.config for stage in staged.stages)
    assert (first.linearize.stage, second.linearize.stage) == ('attention', 'finetune')
    assert first.output_dir == str(tmp_path / 'lin' / 'stage1') and not first.train.ema
    assert second.linearize.student_weights == str(tmp_path / 'lin' / 'stage1' / 'model.safetensors')
    assert build_task(first).staged_run() is None  # a stage is one run
    assert task.inference_task().name == 'segmentation' and task.final_run_dir('runs/x') == 'runs/x/stage2'
    assert task.prediction_defaults() == task.inference_task().prediction_defaults()
    only_finetune = build_task(OmegaConf.merge(cfg, {'linearize': {'attention_epochs': 0}})).staged_run()
    assert [stage.folder for stage in only_finetune.stages] == ['stage2']


class _TwoRuns(ClassificationTask):
    """A toy staged task: two classification runs, the second starting from the first's weights."""
    name = 'test_two_runs'

    def staged_run(self):
        out = self.cfg.output_dir
        first = OmegaConf.merge(self.cfg, {'task': 'classification', 'output_dir': os.path.join(out, 'a'),
                                           'train': {'max_steps': 2}})
        second = OmegaConf.merge(self.cfg, {'task': 'classification', 'output_dir': os.path.join(out, 'b'),
                                            'model': {'pretrained_file': os.path.join(out, 'a', 'model.safetensors')},
                                            'train': {'max_steps': 3}})
        return StagedRun(self.cfg, (Stage('a', first), Stage('b', second)))

    def baselines(self, first_stage, model):
        return {'untrained': model}

    def report(self, state, is_main):
        return {'untrained_top1': state['before']['untrained']['top1'], 'a_steps': state['a']['steps'],
                'b_steps': state['b']['steps'], **state['b']['metrics']}


@pytest.fixture
def two_runs_task():
    register_task(_TwoRuns)
    yield
    TASKS.unregister(_TwoRuns.name)


@pytest.mark.integration
def test_a_staged_task_runs_through_train_without_the_loop_knowing(two_runs_task, tmp_path, caplog):
    cfg = load_config(None, [*TINY_MODEL, *TINY_RUN, 'task=test_two_runs', f'output_dir={tmp_path / "run"}'])
    with caplog.at_level(logging.INFO, logger='linvit'):
        report = train(cfg)
    run = tmp_path / 'run'
    assert report['a_steps'] == 2 and report['b_steps'] == 3 and 0 <= report['untrained_top1'] <= 1
    assert json.loads((run / 'metrics.json').read_text()) == report
    assert report['top1'] == json.loads((run / 'b' / 'metrics.json').read_text())['top1']
    b_weights, run_weights = load_file(run / 'b' / 'model.safetensors'), load_file(run / 'model.safetensors')
    assert all(torch.equal(b_weights[k], run_weights[k]) for k in b_weights)
    state = (run / 'test_two_runs.json').read_text()
    assert set(json.loads(state)) == {'before', 'a', 'b'}
    assert 'continue with' not in caplog.text  # a stage's own step budget is not the run's to continue
    assert train(cfg, resume=True) == report
    assert (run / 'test_two_runs.json').read_text() == state  # finished stages are kept, not run (or timed) again


def _quoted_strings(path: Path):
    return {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)
            and isinstance(node.value, str)}


@pytest.mark.parametrize('module', TASK_FREE)
def test_modules_that_serve_every_task_name_none(module):
    path = PACKAGE / module
    named = sorted(_quoted_strings(path) & set(TASKS.names()))
    assert not named, f"{module} names the task(s) {named}: ask the Task instead"
    text = path.read_text()
    for section in ('.seg.', '.linearize.', "'seg'", "'linearize'"):
        assert section not in text, f"{module} reads a task's config section ({section})"
