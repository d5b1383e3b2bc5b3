"""Overrides for tiny, fast training runs: a 2-block, 48-wide linvit at 32 px on a few synthetic images
(classification: TINY_MODEL + TINY_RUN; segmentation: TINY_MODEL + TINY_SEG; detection: TINY_MODEL + TINY_DET, at
64 px: Faster R-CNN on the built-in shapes)."""
TINY_MODEL = ['model.name=linvit_tiny_patch16_224', 'model.kwargs.depth=2', 'model.kwargs.embed_dim=48',
              'model.kwargs.num_heads=3', 'model.kwargs.patch_size=8']
TINY_RUN = ['data.img_size=32', 'data.batch_size=8', 'data.num_workers=0', 'data.synthetic.train_size=64',
            'data.synthetic.val_size=24', 'data.aug.scale=[0.7,1.0]', 'train.epochs=2', 'train.log_every=1',
            'train.warmup_epochs=0.5', 'train.lr=2e-3', 'train.pictures=false', 'device=cpu']
TINY_SEG = ['task=segmentation', 'data.img_size=32', 'data.batch_size=8', 'data.num_workers=0',
            'data.synthetic.train_size=32', 'data.synthetic.val_size=6', 'data.aug.scale_range=[0.75,1.25]',
            'data.aug.color_jitter=0.0', 'seg.neck_dim=16', 'seg.head_dim=16', 'seg.eval.mode=whole', 'train.epochs=2',
            'train.log_every=1', 'train.warmup_epochs=0.5', 'train.lr=2e-3', 'train.pictures=false', 'device=cpu']
TINY_DET = ['task=detection', 'data.img_size=64', 'data.batch_size=4', 'data.num_workers=0',
            'data.synthetic.train_size=16', 'data.synthetic.val_size=6', 'train.epochs=2', 'train.log_every=1',
            'train.warmup_epochs=0.5', 'train.lr=1e-3', 'device=cpu', 'detection.neck_dim=32',
            'detection.score_thresh=0.0']

#: a tiny softmax ViT (timm's), the teacher the linearization tests start from
TEACHER_MODEL = ['model.name=vit_tiny_patch16_224', 'model.kwargs.depth=2', 'model.kwargs.embed_dim=48',
                 'model.kwargs.num_heads=3', 'model.kwargs.patch_size=8']

#: the finished runs several test modules read, trained once per test session (tests/conftest.py ``shared_run``)
SHARED_RUNS = {
    'cls': [*TINY_MODEL, *TINY_RUN, 'train.epochs=1'],
    'cls_ema': [*TINY_MODEL, *TINY_RUN, 'train.epochs=1', 'train.ema=true', 'train.ema_decay=0.5'],
    'seg': [*TINY_MODEL, *TINY_SEG, 'train.epochs=1'],
    'teacher': [*TEACHER_MODEL, *TINY_RUN],
    'det': [*TINY_MODEL, *TINY_DET, 'train.epochs=1', 'train.pictures=false'],
}
