"""Overrides for a tiny, fast training run: a 2-block, 48-wide linvit at 32 px on 64 synthetic images."""
TINY_MODEL = ['model.name=linvit_tiny_patch16_224', 'model.kwargs.depth=2', 'model.kwargs.embed_dim=48',
              'model.kwargs.num_heads=3', 'model.kwargs.patch_size=8']
TINY_RUN = ['data.img_size=32', 'data.batch_size=8', 'data.num_workers=0', 'data.synthetic.train_size=64',
            'data.synthetic.val_size=24', 'data.aug.scale=[0.7,1.0]', 'train.epochs=2', 'train.log_every=1',
            'train.warmup_epochs=0.5', 'train.lr=2e-3', 'train.pictures=false', 'device=cpu']
