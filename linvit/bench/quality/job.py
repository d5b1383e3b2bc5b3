"""One run of the quality check in its own process (its own seconds, memory and deadline), through the engine's
functions, never through a script path:

    python -m linvit.bench.quality.job JOB_JSON     # what the runner starts; output in logs/<run>.log

'train' and 'linearize' are ``linvit.engine.train`` of their recipe with the run's overrides (the linearize task
runs its two stages itself); 'eval' is ``linvit.engine.evaluate`` of a run folder's weights with the config saved
beside them (the architecture as trained) and the run's overrides (data, size). The process ends with one line: the
final metrics, or the error that stopped it (the report quotes it), with the exit status 1.

Imports at module level are the standard library only: the runner builds jobs without loading the training stack.
"""
import dataclasses
import json
import logging
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ['JOB_KINDS', 'Job', 'job_main']

JOB_KINDS = ('train', 'linearize', 'eval')
#: what evaluating saved weights replaces in their saved config: the weights loaded at the start of their training
_UNUSED_WITH_WEIGHTS = ('model.pretrained_file=null',)


@dataclass(frozen=True)
class Job:
    """What one run's process hands to the engine."""
    kind: str                                # a JOB_KINDS word
    overrides: Tuple[str, ...]               # dotted config overrides ('data.img_size=1024', ...)
    recipe: Optional[Dict[str, Any]] = None  # train, linearize: the config values the overrides apply to
    weights: Optional[str] = None            # eval: the run folder whose weights and saved config are evaluated
    out: Optional[str] = None                # eval: the folder of its metrics.json

    def argv(self) -> List[str]:
        """The command of this job's process."""
        return [sys.executable, '-m', __name__, json.dumps(dataclasses.asdict(self))]

    def weights_file(self) -> str:
        """eval: the weights the run folder prefers (model.safetensors, else best.pt, ...)."""
        from linvit.engine.run_files import find_run_files
        return find_run_files(self.weights).weights_path

    def config(self) -> Any:
        """The resolved run config (a read-only DictConfig with RunConfig's keys)."""
        from linvit.engine import config_from_yaml, load_config
        if self.kind == 'eval':
            from linvit.engine.run_files import saved_config_text
            weights = self.weights_file()
            saved = saved_config_text(weights)
            if saved is None:
                raise FileNotFoundError(f"{weights} carries no saved config: it was not written by a linvit run")
            return load_config(None, [*_UNUSED_WITH_WEIGHTS, *self.overrides], base=config_from_yaml(saved))
        return load_config(None, self.overrides, base=self.recipe)

    def run(self) -> Dict[str, Any]:
        """Train (a linearization too) or evaluate; the final metrics (what the run's metrics.json holds)."""
        from linvit.engine import evaluate, train
        cfg = self.config()
        if self.kind == 'eval':
            return evaluate(cfg, self.weights_file(), self.out)
        return train(cfg)


def job_from_json(text: str) -> Job:
    """The Job of a run's command line (``Job.argv``); ValueError for an unknown kind."""
    values = json.loads(text)
    if values.get('kind') not in JOB_KINDS:
        raise ValueError(f"a job's kind is one of {list(JOB_KINDS)}, got {values.get('kind')!r}")
    return Job(**{**values, 'overrides': tuple(values['overrides'])})


def one_line(error: BaseException) -> str:
    """'ConfigError: ...' on one line: the last line of the run's log, which the report quotes."""
    text = ' '.join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def job_main(argv: Sequence[str]) -> int:
    """``python -m linvit.bench.quality.job JOB_JSON``: 0 and the metrics, or 1 and the error, each on the last
    line (the traceback above it, in the log)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(asctime)s %(levelname)s %(message)s',
                        datefmt='%H:%M:%S')
    (text,) = argv
    try:
        metrics = job_from_json(text).run()
    except Exception as error:  # noqa: BLE001  (any failure is the run's row: its last line says why)
        traceback.print_exc(file=sys.stdout)
        print(one_line(error), flush=True)
        return 1
    print(' '.join(f"{key}={value}" for key, value in metrics.items()), flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(job_main(sys.argv[1:]))
