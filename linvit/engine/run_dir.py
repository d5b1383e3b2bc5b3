"""The run folder's layout, in one place: ``RunDir`` knows the name of every file and folder a run holds.

    files = RunDir(cfg.output_dir)
    files.last                       # runs/cls_demo/last.pt
    files.picture('val', 40)         # runs/cls_demo/pictures/val_step000040.png
    files.stage('stage1').weights    # runs/lin/stage1/model.safetensors (a stage is a run folder of its own)

A run directory (written by rank 0 only; ``linvit.engine.trainer`` fills it, ``run_files`` finds and clears it):

    config.yaml          the resolved config
    launch.json          which torchrun launch started the run (its restarts continue it: run_files.restart_continues)
    train.log            linvit's, timm's and Python's warnings' log records
    metrics.csv          a train row every train.log_every steps, a val row at each evaluation
    metrics.json         the final evaluation (a staged run: the task's report)
    last.pt, best.pt     training checkpoints (atomic): the latest, the best evaluation's
    last.dcp/            a sharded run's (parallel.fsdp) model and optimizer shards beside last.pt
    model.safetensors    the evaluated weights (the EMA weights when train.ema is on)
    tb/                  TensorBoard events
    curves.png           the training curves, from metrics.csv
    pictures/            <name>_stepNNNNNN.png: the evaluations' pictures
    <task>.json          a staged run's state (what its baselines and stages measured), beside
    stage1/, stage2/     its stages, each a run directory of its own
    model.onnx, eval_*/  derived from the weights by tools/export_onnx.py and train.py --eval-only
    features.onnx        the backbone and feature pyramid alone (tools/export_onnx.py --features)
    hub/                 the run as a timm / Hugging Face model folder (tools/export_hub.py)

It imports nothing of linvit, so every engine module (the config's checks included) can name these files.
"""
import os
from dataclasses import dataclass
from typing import ClassVar, Tuple

__all__ = ['RunDir']


@dataclass(frozen=True)
class RunDir:
    """The paths of one run folder's files (the layout in this module's docstring); nothing is read or created."""
    path: str  # the run folder (cfg.output_dir)

    CONFIG: ClassVar[str] = 'config.yaml'
    #: the torchrun launch that started the run (its elastic restarts continue it rather than being refused)
    LAUNCH: ClassVar[str] = 'launch.json'
    LOG: ClassVar[str] = 'train.log'
    METRICS_CSV: ClassVar[str] = 'metrics.csv'
    METRICS_JSON: ClassVar[str] = 'metrics.json'
    LAST: ClassVar[str] = 'last.pt'
    #: a sharded run's (parallel.fsdp) model and optimizer shards of last.pt (torch.distributed.checkpoint)
    LAST_SHARDS: ClassVar[str] = 'last.dcp'
    BEST: ClassVar[str] = 'best.pt'
    WEIGHTS: ClassVar[str] = 'model.safetensors'
    TENSORBOARD: ClassVar[str] = 'tb'
    CURVES: ClassVar[str] = 'curves.png'
    PICTURES: ClassVar[str] = 'pictures'
    ONNX: ClassVar[str] = 'model.onnx'
    #: the ONNX export of the model's backbone and feature pyramid alone (tools/export_onnx.py --features)
    FEATURES_ONNX: ClassVar[str] = 'features.onnx'
    #: the timm / Hugging Face model folder of the run's weights (tools/export_hub.py's default)
    HUB: ClassVar[str] = 'hub'
    #: the start of an evaluation folder's name (eval_<weights stem>/)
    EVALUATION_PREFIX: ClassVar[str] = 'eval_'
    #: the folders of a run trained in stages (a linearization), in order
    STAGES: ClassVar[Tuple[str, ...]] = ('stage1', 'stage2')
    #: the weights a run folder offers, in order of preference
    WEIGHT_FILES: ClassVar[Tuple[str, ...]] = (WEIGHTS, BEST, LAST)
    #: the training checkpoints, in order of preference
    CHECKPOINTS: ClassVar[Tuple[str, ...]] = (BEST, LAST)

    def join(self, name: str) -> str:
        """The path of ``name`` inside the run folder."""
        return os.path.join(self.path, name)

    @property
    def config(self) -> str:
        """config.yaml: the resolved config."""
        return self.join(self.CONFIG)

    @property
    def launch(self) -> str:
        """launch.json: which torchrun launch started the run."""
        return self.join(self.LAUNCH)

    @property
    def log(self) -> str:
        """train.log."""
        return self.join(self.LOG)

    @property
    def metrics_csv(self) -> str:
        """metrics.csv: the train and val rows."""
        return self.join(self.METRICS_CSV)

    @property
    def metrics_json(self) -> str:
        """metrics.json: the final evaluation."""
        return self.join(self.METRICS_JSON)

    @property
    def last(self) -> str:
        """last.pt: the latest checkpoint, what --resume continues."""
        return self.join(self.LAST)

    @property
    def last_shards(self) -> str:
        """last.dcp/: a sharded run's model and optimizer state of last.pt, one file per rank (any world size
        loads it)."""
        return self.join(self.LAST_SHARDS)

    @property
    def best(self) -> str:
        """best.pt: the checkpoint of the best evaluation."""
        return self.join(self.BEST)

    @property
    def weights(self) -> str:
        """model.safetensors: the evaluated weights."""
        return self.join(self.WEIGHTS)

    @property
    def tensorboard(self) -> str:
        """tb/: the TensorBoard events."""
        return self.join(self.TENSORBOARD)

    @property
    def curves(self) -> str:
        """curves.png: the training curves."""
        return self.join(self.CURVES)

    @property
    def pictures(self) -> str:
        """pictures/: the evaluations' pictures."""
        return self.join(self.PICTURES)

    @property
    def onnx(self) -> str:
        """model.onnx: the ONNX export of the run's weights (tools/export_onnx.py's default)."""
        return self.join(self.ONNX)

    @property
    def features_onnx(self) -> str:
        """features.onnx: the ONNX export of the backbone and feature pyramid (tools/export_onnx.py --features)."""
        return self.join(self.FEATURES_ONNX)

    @property
    def hub(self) -> str:
        """hub/: the run as a timm / Hugging Face model folder (tools/export_hub.py's default)."""
        return self.join(self.HUB)

    def picture(self, name: str, step: int) -> str:
        """pictures/<name>_stepNNNNNN.png: the picture ``name`` of the evaluation at ``step``."""
        return os.path.join(self.pictures, f'{name}_step{step:06d}.png')

    def state(self, task_name: str) -> str:
        """<task>.json: what a staged run of the task ``task_name`` measured (its baselines and stages)."""
        return self.join(f'{task_name}.json')

    def stage(self, folder: str) -> 'RunDir':
        """The run folder of a stage (``folder``: one of STAGES) inside this one."""
        return RunDir(self.join(folder))

    def evaluation(self, weights_stem: str) -> str:
        """eval_<weights stem>/: where train.py --eval-only writes the evaluation of the weights file beside it."""
        return self.join(f'{self.EVALUATION_PREFIX}{weights_stem}')
