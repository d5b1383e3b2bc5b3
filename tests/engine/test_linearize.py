"""task: linearize on tiny runs: stage 1 lowers each layer's attention-output error and changes only the tensors
it should, the report's numbers against independent evaluations, resume in the middle of either stage, the
distillation loss against its formula, segmentation, and the command line."""
import csv
import json
import os
import shutil

import pytest
import timm
import torch
import torch.nn.functional as F
from cli import run_train_py
from safetensors.torch import load_file, save_file
from tiny_run import TEACHER_MODEL, TINY_RUN, TINY_SEG

import linvit
from linvit.engine import Checkpoint, ConfigError, load_config, train
from linvit.engine.loading import load_trained
from linvit.engine.tasks.distillation import DistillationLoss
from linvit.engine.tasks.linearize import STAGE_DIRS, LinearizeTask, resolve_teacher

pytestmark = pytest.mark.integration  # trains or starts interpreters

#: 2 blocks x 3 heads x (8 x 8 weight + 8 bias) per block: the hedgehog maps' tensors
MAP_KEYS = sorted(f'blocks.{b}.attn.feature_map.{p}' for b in range(2) for p in ('weight', 'bias'))


@pytest.fixture(scope='module')
def teacher_dir(tmp_path_factory, shared_run):
    """A softmax ViT trained for 2 epochs through train() on the tiny synthetic task: a run directory."""
    return str(shared_run('teacher', tmp_path_factory.mktemp('teacher') / 'run'))


def lin_config(teacher_dir, out, *overrides):
    return load_config(None, [*TINY_RUN, 'task=linearize', f'linearize.teacher={teacher_dir}', f'output_dir={out}',
                              'linearize.speed=false', 'train.epochs=1', 'linearize.attention_lr=1e-2', *overrides])


def _teacher_and_student(teacher_dir):
    """The teacher (its run's weights) and its conversion with a hedgehog map, built by hand (not by the task)."""
    torch.manual_seed(0)
    teacher = timm.create_model('vit_tiny_patch16_224', img_size=32, depth=2, embed_dim=48, num_heads=3,
                                patch_size=8, num_classes=4)
    teacher.load_state_dict(load_file(os.path.join(teacher_dir, 'model.safetensors')))
    student = timm.create_model('vit_tiny_patch16_224', img_size=32, depth=2, embed_dim=48, num_heads=3,
                                patch_size=8, num_classes=4)
    student.load_state_dict(teacher.state_dict())
    linvit.convert_to_linear(student, feature_map='hedgehog')
    return teacher.eval(), student.eval()


def _layer_errors(teacher, student, images):
    """Each block's relative squared error of the student's attention on the teacher's own attention inputs."""
    inputs, outputs = {}, {}

    def keeper(index):
        def keep(module, args, output):
            inputs[index], outputs[index] = args[0], output
        return keep

    hooks = [block.attn.register_forward_hook(keeper(i)) for i, block in enumerate(teacher.blocks)]
    with torch.no_grad():
        teacher(images)
        errors = [((student.blocks[i].attn(inputs[i]) - outputs[i]).pow(2).mean() / outputs[i].pow(2).mean()).item()
                  for i in range(len(teacher.blocks))]
    for hook in hooks:
        hook.remove()
    return errors


def _val_images(n=16):
    """Normalised-scale random images: attention imitation is judged on inputs the student was not trained on."""
    torch.manual_seed(3)
    return torch.randn(n, 3, 32, 32)


def _sharpened_teacher(teacher_dir, out, factor=4.0):
    """A copy of the teacher run whose q and k projections are scaled by ``factor``: peaked softmax attention, far
    from what an untrained linear map gives (the tiny teacher's own attention is nearly uniform)."""
    shutil.copytree(teacher_dir, out)
    weights = load_file(os.path.join(out, 'model.safetensors'))
    for key in [k for k in weights if k.endswith('attn.qkv.weight') or k.endswith('attn.qkv.bias')]:
        rows = weights[key].shape[0]
        weights[key][:2 * rows // 3] *= factor
    save_file(weights, os.path.join(out, 'model.safetensors'))
    return str(out)


def test_stage1_lowers_every_layers_attention_output_error(teacher_dir, tmp_path):
    teacher_dir = _sharpened_teacher(teacher_dir, tmp_path / 'sharp')
    teacher, student = _teacher_and_student(teacher_dir)
    images = _val_images()
    before = _layer_errors(teacher, student, images)
    cfg = lin_config(teacher_dir, tmp_path / 'lin', 'linearize.attention_epochs=3')
    train(cfg)
    student.load_state_dict(load_file(tmp_path / 'lin' / STAGE_DIRS['attention'] / 'model.safetensors'))
    after = _layer_errors(teacher, student, images)
    assert all(a < 0.85 * b for a, b in zip(after, before)), (before, after)  # measured 0.64x and 0.79x


def test_stage1_changes_only_the_added_tensors(teacher_dir, tmp_path):
    _, start = _teacher_and_student(teacher_dir)
    train(lin_config(teacher_dir, tmp_path / 'lin'))
    trained = load_file(tmp_path / 'lin' / STAGE_DIRS['attention'] / 'model.safetensors')
    initial = start.state_dict()
    assert sorted(trained) == sorted(initial)
    changed = sorted(key for key in initial if not torch.equal(initial[key], trained[key]))
    assert changed == MAP_KEYS


def test_stage1_with_train_qk_changes_q_and_k_rows_only(teacher_dir, tmp_path):
    _, start = _teacher_and_student(teacher_dir)
    train(lin_config(teacher_dir, tmp_path / 'lin', 'linearize.train_qk=true'))
    trained = load_file(tmp_path / 'lin' / STAGE_DIRS['attention'] / 'model.safetensors')
    initial = start.state_dict()
    changed = sorted(key for key in initial if not torch.equal(initial[key], trained[key]))
    qkv = sorted(f'blocks.{b}.attn.qkv.{p}' for b in range(2) for p in ('weight', 'bias'))
    assert changed == sorted(MAP_KEYS + qkv)
    for key in qkv:
        rows = initial[key].shape[0]
        assert torch.equal(initial[key][2 * rows // 3:], trained[key][2 * rows // 3:]), f"{key}: v rows moved"
        assert not torch.equal(initial[key][:2 * rows // 3], trained[key][:2 * rows // 3])


def _hand_top1(model, cfg):
    """Top-1 of ``model`` on the run's validation set, counted here (not by the engine's meter)."""
    from linvit.data import build_classification_datasets
    from linvit.engine.tasks import normalization_of
    _, val, _ = build_classification_datasets(cfg.data, *normalization_of('vit_tiny_patch16_224'))
    hits = 0
    with torch.no_grad():
        for index in range(len(val)):
            image, label = val[(index, 0)]
            hits += int(model(image[None]).argmax(-1).item() == label)
    return hits / len(val)


def test_report_holds_the_accuracies_steps_and_files(teacher_dir, tmp_path):
    cfg = lin_config(teacher_dir, tmp_path / 'lin', 'linearize.speed=true')
    report = train(cfg)
    teacher, converted = _teacher_and_student(teacher_dir)
    assert report['teacher_top1'] == pytest.approx(_hand_top1(teacher, cfg))
    assert report['converted_top1'] == pytest.approx(_hand_top1(converted, cfg))
    stage1 = json.load(open(tmp_path / 'lin' / STAGE_DIRS['attention'] / 'metrics.json'))
    final = json.load(open(tmp_path / 'lin' / STAGE_DIRS['finetune'] / 'metrics.json'))
    assert report['stage1_top1'] == stage1['top1'] and report['top1'] == final['top1']
    steps_per_epoch = 64 // 8
    assert report['stage1_steps'] == steps_per_epoch and report['stage2_steps'] == steps_per_epoch
    assert report['teacher_steps'] == 2 * steps_per_epoch
    assert report['student_steps_fraction'] == pytest.approx(1.0)
    assert report['stage1_wall_s'] > 0 and report['stage2_wall_s'] > 0
    assert set(report['speed']) == {f'{who}_img_per_s@{s}px' for who in ('student', 'teacher') for s in (32, 64)} | \
        {'student_over_teacher@32px', 'student_over_teacher@64px'}
    assert json.load(open(tmp_path / 'lin' / 'metrics.json')) == json.loads(json.dumps(report))
    rows = list(csv.DictReader(open(tmp_path / 'lin' / 'metrics.csv')))
    assert [r['split'] for r in rows[:4]] == ['teacher', 'converted', 'stage1', 'final']
    assert float(rows[3]['top1']) == pytest.approx(report['top1'])
    # the final weights are the converted model's own keys: they load into a conversion of the teacher
    _, student = _teacher_and_student(teacher_dir)
    student.load_state_dict(load_file(tmp_path / 'lin' / 'model.safetensors'))
    assert _hand_top1(student, cfg) == pytest.approx(report['top1'])
    # prediction and export load the run as the task it linearized, with its class names (from stage 2)
    trained = load_trained(str(tmp_path / 'lin'))
    assert trained.task == 'classification' and trained.class_names == ['red-red', 'red-blue', 'blue-red', 'blue-blue']
    assert _hand_top1(trained.model, cfg) == pytest.approx(report['top1'])


class Crash(RuntimeError):
    pass


def _crash_at(monkeypatch, stage_dir, step):
    """Make the run of ``stage_dir`` raise Crash once it reaches ``step`` (after its last.pt of that step)."""
    original = Checkpoint.save

    def save_then_crash(self, path):
        original(self, path)
        if str(path).endswith(os.path.join(stage_dir, 'last.pt')) and self.progress.step == step:
            raise Crash(f"interrupted at step {step}")

    monkeypatch.setattr(Checkpoint, 'save', save_then_crash)


def _train_losses(run_dir):
    return [(r['step'], r['loss']) for r in csv.DictReader(open(os.path.join(run_dir, 'metrics.csv')))
            if r['split'] == 'train']


@pytest.mark.parametrize('stage', ['attention', 'finetune'])
def test_resume_in_the_middle_of_a_stage_reproduces_the_losses(teacher_dir, tmp_path, monkeypatch, stage):
    overrides = ['train.checkpoint_every=3', 'linearize.attention_epochs=1']
    whole = train(lin_config(teacher_dir, tmp_path / 'whole', *overrides))
    _crash_at(monkeypatch, STAGE_DIRS[stage], 3)
    with pytest.raises(Crash):
        train(lin_config(teacher_dir, tmp_path / 'cut', *overrides))
    monkeypatch.undo()
    resumed = run_train_py('--resume', str(tmp_path / 'cut'))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for directory in STAGE_DIRS.values():
        assert _train_losses(tmp_path / 'cut' / directory) == _train_losses(tmp_path / 'whole' / directory)
    report = json.load(open(tmp_path / 'cut' / 'metrics.json'))
    assert report['top1'] == whole['top1'] and report['stage1_top1'] == whole['stage1_top1']
    assert report['stage1_steps'] == whole['stage1_steps'] and report['stage2_steps'] == whole['stage2_steps']


def test_distillation_loss_is_the_weighted_sum_of_task_loss_and_tempered_kl():
    torch.manual_seed(0)
    student, teacher, labels = torch.randn(5, 4), torch.randn(5, 4), torch.randint(0, 4, (5,))
    loss = DistillationLoss(torch.nn.CrossEntropyLoss(), weight=0.3, temperature=2.0)(student, (labels, teacher))
    p = torch.softmax(teacher / 2, -1)
    kl = (p * (p.log() - torch.log_softmax(student / 2, -1))).sum(-1).mean()
    assert loss.item() == pytest.approx((0.7 * F.cross_entropy(student, labels) + 0.3 * 4 * kl).item(), rel=1e-6)


def test_segmentation_distillation_averages_the_kl_over_labelled_pixels():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    labels = torch.randint(0, 3, (2, 4, 4))
    labels[0, :2] = 255
    loss = DistillationLoss(lambda s, y: torch.zeros(()), weight=1.0, temperature=1.0, ignore_index=255)
    p = torch.softmax(teacher, 1)
    kl = (p * (p.log() - torch.log_softmax(student, 1))).sum(1)
    valid = labels != 255
    assert loss(student, (labels, teacher)).item() == pytest.approx(kl[valid].mean().item(), rel=1e-6)


def test_segmentation_teacher_is_linearized(tmp_path):
    seg_model = [*TEACHER_MODEL]
    teacher = tmp_path / 'teacher'
    train(load_config(None, [*seg_model, *TINY_SEG, 'train.epochs=1', f'output_dir={teacher}']))
    cfg = load_config(None, [*TINY_SEG, 'task=linearize', f'linearize.teacher={teacher}', 'linearize.speed=false',
                             'train.epochs=1', f'output_dir={tmp_path / "lin"}'])
    report = train(cfg)
    for key in ('teacher_miou', 'converted_miou', 'stage1_miou', 'miou'):
        assert 0 <= report[key] <= 1, key
    assert report['teacher_input'] == "the student's images as they are"
    student = load_file(tmp_path / 'lin' / 'model.safetensors')
    assert any(key.startswith('backbone.blocks.0.attn.feature_map') for key in student)


def test_a_pooled_teacher_without_class_token_is_linearized_as_it_was_built(tmp_path):
    """A timm layout without a class token (average pooling, as "Better plain ViT baselines" trains): the student
    keeps it (its weights load into a hand-made conversion of that layout, with the report's accuracy)."""
    pooled = ['model.kwargs.global_pool=avg', 'model.kwargs.class_token=false']
    teacher_dir = tmp_path / 'teacher'
    train(load_config(None, [*TEACHER_MODEL, *pooled, *TINY_RUN, 'train.epochs=1', f'output_dir={teacher_dir}']))
    cfg = lin_config(str(teacher_dir), tmp_path / 'lin')
    report = train(cfg)
    student = timm.create_model('vit_tiny_patch16_224', img_size=32, depth=2, embed_dim=48, num_heads=3,
                                patch_size=8, num_classes=4, global_pool='avg', class_token=False)
    linvit.convert_to_linear(student, feature_map='hedgehog')
    weights = load_file(tmp_path / 'lin' / 'model.safetensors')
    assert 'cls_token' not in weights and weights['pos_embed'].shape[1] == 4 * 4
    student.load_state_dict(weights)
    assert _hand_top1(student.eval(), cfg) == pytest.approx(report['top1'])


def test_a_linear_teacher_or_a_missing_one_is_a_clear_error(teacher_dir, tmp_path):
    missing = run_train_py('--config', 'configs/linearize_cls_fmnist.yaml', f'output_dir={tmp_path / "x"}',
                           'linearize.teacher=null')
    assert missing.returncode == 2 and 'linearize.teacher' in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    absent = run_train_py('--config', 'configs/linearize_cls_fmnist.yaml', f'output_dir={tmp_path / "x"}',
                          f'linearize.teacher={tmp_path / "nowhere"}', f'data.root={tmp_path}')
    assert absent.returncode == 1 and 'nowhere' in absent.stderr and 'Traceback' not in absent.stderr
    linear_teacher = tmp_path / 'linear_teacher'
    train(load_config(None, ['model.name=linvit_tiny_patch16_224', *TEACHER_MODEL[1:], *TINY_RUN, 'train.epochs=1',
                             f'output_dir={linear_teacher}']))
    task = LinearizeTask(resolve_teacher(lin_config(str(linear_teacher), tmp_path / 'y')))
    with pytest.raises(ValueError, match='already uses linear attention'):
        task.build_teacher(4)


def test_a_first_start_refused_by_its_batch_size_reruns_corrected_without_overwrite(teacher_dir, tmp_path):
    out = tmp_path / 'lin'
    command = ['--config', 'configs/cls_demo.yaml', *TINY_RUN, 'task=linearize', f'linearize.teacher={teacher_dir}',
               'linearize.speed=false', 'train.epochs=1', f'output_dir={out}']
    refused = run_train_py(*command, 'data.batch_size=100')
    assert refused.returncode == 2 and 'lower data.batch_size' in refused.stderr, refused.stderr[-2000:]
    assert not out.exists()  # no config.yaml, no baselines' state, no stage folder: nothing that counts as a run
    corrected = run_train_py(*command, 'data.batch_size=8')
    assert corrected.returncode == 0, corrected.stderr[-2000:]
    assert set(STAGE_DIRS.values()) <= set(os.listdir(out)) and 'top1' in json.load(open(out / 'metrics.json'))


def test_the_run_folder_rules_know_the_stage_folders():
    from linvit.engine.run_files import RUN_STAGES
    assert set(STAGE_DIRS.values()) == set(RUN_STAGES)


def test_a_larger_student_size_feeds_the_teacher_at_its_own_size(teacher_dir, tmp_path):
    """Stage 2 at 48 px for a 32 px teacher: the teacher sees the images resized to 32 px (its report accuracy is
    that, counted here by hand), the student's position embedding is resampled, and both stages run at 48 px."""
    cfg = lin_config(teacher_dir, tmp_path / 'lin', 'data.img_size=48', 'linearize.attention_epochs=0',
                     'linearize.speed=true')
    report = train(cfg)
    assert report['teacher_input'] == 'resized to 32 px (its training size)'
    assert report['img_size'] == 48 and report['teacher_img_size'] == 32 and report['stage1_steps'] == 0
    assert report['stage1_top1'] is None and not (tmp_path / 'lin' / STAGE_DIRS['attention']).exists()
    teacher, _ = _teacher_and_student(teacher_dir)
    from linvit.data import build_classification_datasets
    from linvit.engine.tasks import normalization_of
    _, val, _ = build_classification_datasets(cfg.data, *normalization_of('vit_tiny_patch16_224'))
    with torch.no_grad():
        hits = sum(int(teacher(F.interpolate(val[(i, 0)][0][None], size=(32, 32), mode='bilinear',
                                             antialias=True)).argmax(-1).item() == val[(i, 0)][1])
                   for i in range(len(val)))
    assert report['teacher_top1'] == pytest.approx(hits / len(val))
    weights = load_file(tmp_path / 'lin' / 'model.safetensors')
    assert weights['pos_embed'].shape[1] == 1 + 6 * 6
    assert set(report['speed']) >= {'student_img_per_s@48px', 'teacher_img_per_s@96px'}


def test_attention_weights_of_both_layers_match_their_n_by_n_matrices():
    """The weights stage 1 compares: softmax's rows of softmax(q k^T / sqrt(d)) from timm's Attention (checked
    against the layer's own output: weights @ v then proj), and linear attention's normalised phi(q) phi(k)^T."""
    from timm.layers import Attention

    from linvit.engine.tasks.distillation import (
        attention_transfer_loss,
        linear_attention_weights,
        softmax_attention_weights,
    )
    torch.manual_seed(0)
    attn = Attention(24, num_heads=3).eval()
    x = torch.randn(2, 7, 24)
    queries = torch.tensor([0, 3, 6])
    weights = softmax_attention_weights(attn, x, queries)
    v = attn.qkv(x).reshape(2, 7, 3, 3, 8).permute(2, 0, 3, 1, 4)[2]
    mixed = (weights @ v).transpose(1, 2).reshape(2, 3, 24)
    torch.testing.assert_close(attn.proj(mixed), attn(x)[:, queries], rtol=1e-5, atol=1e-6)
    linear = linvit.layers.LinearAttention(24, num_heads=3, feature_map='hedgehog').eval()
    w_lin = linear_attention_weights(linear, x, queries)
    v_lin = linear.qkv(x).reshape(2, 7, 3, 3, 8).permute(2, 0, 3, 1, 4)[2]
    out = linear.proj((w_lin @ v_lin).transpose(1, 2).reshape(2, 3, 24))
    torch.testing.assert_close(out, linear(x)[:, queries], rtol=1e-5, atol=1e-6)
    # the loss: relative squared error per layer, plus the weighted cross-entropy of the weights
    student, teacher = torch.randn(2, 1, 7, 24), torch.randn(2, 1, 7, 24)
    ce = -(weights * w_lin.clamp_min(1e-12).log()).sum(-1).mean()
    relative = (student - teacher).pow(2).mean() / teacher.pow(2).mean()
    got = attention_transfer_loss(0.5)((student, w_lin[:, None]), (teacher, weights[:, None]))
    assert got.item() == pytest.approx((relative + 0.5 * ce).item(), rel=1e-5)


ROPE_TEACHER = ['model.name=vit_small_patch16_dinov3', 'model.kwargs.depth=2', 'model.kwargs.embed_dim=48',
                'model.kwargs.num_heads=3', 'model.kwargs.patch_size=8']


def test_a_rope_teacher_is_linearized_with_its_rotary_embeddings(tmp_path):
    """A DINOv3-layout teacher (rotary embeddings, registers, layer scale) linearizes end to end; stage 1 hands each
    student layer the rope its model passes it: AttentionTransfer's outputs on the student's own layer inputs equal
    what the layers gave inside the student's forward (without the ropes they differ)."""
    from linvit.engine.tasks.distillation import AttentionTransfer, rotary_embeddings, transfer_pairs

    teacher_dir = tmp_path / 'teacher'
    train(load_config(None, [*ROPE_TEACHER, *TINY_RUN, 'train.epochs=1', f'output_dir={teacher_dir}']))
    report = train(lin_config(str(teacher_dir), tmp_path / 'lin'))
    for key in ('teacher_top1', 'converted_top1', 'stage1_top1', 'top1'):
        assert 0 <= report[key] <= 100, key
    stage1 = LinearizeTask(resolve_teacher(lin_config(str(teacher_dir), tmp_path / 'stage',
                                                      'linearize.stage=attention')))
    transfer = stage1.build_model(4)
    assert all(rope is not None and rope.shape[-2] == 4 * 4 for rope in (transfer.rope0, transfer.rope1))
    kwargs = dict(img_size=32, depth=2, embed_dim=48, num_heads=3, patch_size=8, num_classes=4)
    teacher = timm.create_model('vit_small_patch16_dinov3', **kwargs).eval()
    teacher.load_state_dict(load_file(teacher_dir / 'model.safetensors'))
    student = linvit.convert_to_linear(timm.create_model('vit_small_patch16_dinov3', **kwargs), feature_map='hedgehog')
    student.load_state_dict(load_file(tmp_path / 'lin' / 'model.safetensors'))
    student.eval()
    paths = transfer_pairs(teacher, student)
    assert paths == ['blocks.0.attn', 'blocks.1.attn']
    images = torch.randn(3, 3, 32, 32)
    inputs, outputs = [], []

    def keep(module, args, output):
        inputs.append(args[0])
        outputs.append(output)

    hooks = [student.get_submodule(path).register_forward_hook(keep) for path in paths]
    with torch.no_grad():
        student(images)
        for hook in hooks:
            hook.remove()
        ropes = rotary_embeddings(teacher, paths, lambda: teacher(images[:1]))
        assert all(rope is not None for rope in ropes)
        got, _ = AttentionTransfer(student, paths, ropes=ropes)(torch.stack(inputs, dim=1))
        without, _ = AttentionTransfer(student, paths)(torch.stack(inputs, dim=1))
    torch.testing.assert_close(got, torch.stack(outputs, dim=1), rtol=1e-5, atol=1e-6)
    assert (without - torch.stack(outputs, dim=1)).abs().max() > 1e-3


def test_distillation_loss_adds_the_relative_error_of_the_tokens():
    torch.manual_seed(0)
    student, teacher, labels = torch.randn(5, 4), torch.randn(5, 4), torch.randint(0, 4, (5,))
    tokens, teacher_tokens = torch.randn(5, 7, 6), torch.randn(5, 7, 6)
    plain = DistillationLoss(torch.nn.CrossEntropyLoss(), weight=0.3, temperature=2.0)(student, (labels, teacher))
    aligned = DistillationLoss(torch.nn.CrossEntropyLoss(), weight=0.3, temperature=2.0, feature_weight=0.7)
    got = aligned((student, tokens), (labels, teacher, teacher_tokens))
    relative = ((tokens.double() - teacher_tokens.double()) ** 2).sum() / (teacher_tokens.double() ** 2).sum()
    assert got.item() == pytest.approx(plain.item() + 0.7 * relative.item(), rel=1e-6)


def test_stage2_with_feature_weight_aligns_the_last_blocks_patch_tokens(teacher_dir, tmp_path):
    """linearize.feature_weight: stage 2's loss on a batch is the distillation loss plus the weight times the
    relative error of the student's last block tokens to the teacher's, both read here through timm's own
    forward_intermediates (patch tokens) and its class token."""
    from linvit.engine.tasks.distillation import student_of

    cfg = resolve_teacher(lin_config(teacher_dir, tmp_path / 'lin', 'linearize.stage=finetune',
                                     'linearize.feature_weight=2.0'))
    task = LinearizeTask(cfg)
    model = task.build_model(4)
    assert set(model.state_dict()) == set(student_of(model).state_dict())
    torch.manual_seed(0)
    with torch.no_grad():  # a student whose tokens differ from the teacher's (a tiny teacher's attention barely counts)
        student_of(model).blocks[1].mlp.fc2.weight.add_(torch.randn_like(student_of(model).blocks[1].mlp.fc2.weight))
    images, labels = torch.randn(3, 3, 32, 32), torch.randint(0, 4, (3,))
    images, targets = task.batch_mixer(4)(images, labels)
    with torch.no_grad():
        loss = task.train_loss()(model(images), targets)

    def last_tokens(vit):  # [B, 1 + 16, C]: the class token of the last block's output, then its patch tokens
        patches, prefix = vit.forward_intermediates(images, indices=[1], output_fmt='NLC', intermediates_only=True,
                                                    return_prefix_tokens=True)[0]
        return torch.cat([prefix, patches], dim=1).double()

    teacher, student = task.teacher.eval(), student_of(model).eval()
    with torch.no_grad():
        ours, theirs = last_tokens(student), last_tokens(teacher)
        plain = DistillationLoss(task.base.train_loss(), cfg.linearize.distill_weight,
                                 cfg.linearize.temperature)(student(images), (labels, teacher(images)))
    relative = ((ours - theirs) ** 2).sum() / (theirs ** 2).sum()
    assert relative > 0.05  # the term is far from zero
    assert loss.item() == pytest.approx(plain.item() + 2.0 * relative.item(), rel=1e-5)


def test_feature_weight_with_a_resized_teacher_is_a_clear_error(teacher_dir, tmp_path):
    cfg = resolve_teacher(lin_config(teacher_dir, tmp_path / 'lin', 'linearize.stage=finetune', 'data.img_size=48',
                                     'linearize.feature_weight=1.0'))
    with pytest.raises(ConfigError, match=r"feature_weight.*resized to its 32 px.*data.img_size=32"):
        LinearizeTask(cfg).build_model(4)


def test_a_rope_segmentation_teacher_is_linearized_with_aligned_patch_features(tmp_path):
    """The segmentation linearization of configs/linearize_seg_rope.yaml at tiny size: a DINOv3-layout backbone
    teacher, stage 2 with the patch-feature term; the student's weights load into the converted timm layout."""
    teacher = tmp_path / 'teacher'
    train(load_config(None, [*ROPE_TEACHER, *TINY_SEG, 'train.epochs=1', f'output_dir={teacher}']))
    cfg = load_config(None, [*TINY_SEG, 'task=linearize', f'linearize.teacher={teacher}', 'linearize.speed=false',
                             'linearize.feature_weight=1.0', 'train.epochs=1', f'output_dir={tmp_path / "lin"}'])
    report = train(cfg)
    for key in ('teacher_miou', 'converted_miou', 'stage1_miou', 'miou'):
        assert 0 <= report[key] <= 1, key
    student = load_file(tmp_path / 'lin' / 'model.safetensors')
    assert any(key.startswith('backbone.blocks.1.attn.feature_map') for key in student)
