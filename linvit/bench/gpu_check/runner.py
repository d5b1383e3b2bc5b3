"""The GPU check's parent process: each chosen section in its own process (``sections``) under its deadline, their
result lines collected as records, the report written (``report``).

    settings = CheckSettings(device='cuda:0').resolved()      # or CheckSettings(device='cpu', quick=True)
    status = run_check(settings, start=time.time())         # writes settings.out/gpu_check.{md,csv} and the plot

Section budgets are shares of the budget (``Preset.shares``; models: the rest, minus ``REPORT_RESERVE_S`` to write the
report); what parity and op leave unused goes to the models. A section still running ``KILL_GRACE_S`` after its
deadline is killed with its process group; the rows it did not report are 'skipped (time budget)', never estimated,
and the rows of a section whose process failed are errors naming its log (logs/<section>.log).
"""
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..processes import child_env, kill_group
from . import sections as section_module
from .plan import REPORT_RESERVE_S, RESULT_MARK, SECTIONS, SKIPPED, CheckSettings, Preset, plan_keys
from .report import failed, report

__all__ = ['KILL_GRACE_S', 'Section', 'section_argv', 'section_env', 'run_sections', 'fill_missing', 'run_check']

KILL_GRACE_S = 2.0  # a section's process is killed this long after its deadline


@dataclass
class Section:
    """A section's process: its log (stdout and stderr; the result lines are read from it as they come), deadline
    and how it ended (exit code, or killed at its deadline)."""
    name: str
    proc: subprocess.Popen
    log: Path
    deadline: float
    started: float
    offset: int = 0
    code: Optional[int] = None
    killed: bool = False
    ended: Optional[float] = None


def section_argv(settings: CheckSettings, section: str, deadline: float) -> List[str]:
    """The command of a section's process: the sections module with the settings (and the section's deadline) as
    JSON."""
    config = dataclasses.asdict(dataclasses.replace(settings, deadline=deadline))
    return [sys.executable, '-m', section_module.__name__, json.dumps(config), section]


def section_env(settings: CheckSettings, section: str) -> Dict[str, str]:
    """The environment of a section's process: this process's linvit importable, compile caches in cache_dir, and
    on a CPU the Triton interpreter for the parity section (so that the kernel itself runs there)."""
    interpret = section == 'parity' and not settings.device.startswith('cuda') and importlib.util.find_spec('triton')
    return child_env(TORCHINDUCTOR_CACHE_DIR=str(Path(settings.cache_dir) / 'inductor'),
                     TRITON_CACHE_DIR=str(Path(settings.cache_dir) / 'triton'),
                     **({'TRITON_INTERPRET': '1'} if interpret else {}))


def start_section(settings: CheckSettings, name: str, deadline: float) -> Section:
    """The section's process under its deadline, its output (result lines too) in logs/<name>.log."""
    log = Path(settings.out) / 'logs' / f"{name}.log"
    with open(log, 'w') as f:
        proc = subprocess.Popen(section_argv(settings, name, deadline), stdout=f, stderr=subprocess.STDOUT,
                                env=section_env(settings, name), start_new_session=True)
    return Section(name, proc, log, deadline, time.time())


def read_records(section: Section) -> List[Dict[str, Any]]:
    """The complete result lines the section's process wrote since the last read."""
    with open(section.log, 'rb') as f:
        f.seek(section.offset)
        data = f.read()
    end = data.rfind(b'\n') + 1
    section.offset += end
    lines = data[:end].decode('utf-8', 'replace').splitlines()
    return [json.loads(line[len(RESULT_MARK):]) for line in lines if line.startswith(RESULT_MARK)]


def wait_sections(sections: Sequence[Section], records: Dict[str, Dict[str, Any]]) -> None:
    """Collect records until every section exited, killing each one KILL_GRACE_S after its deadline."""
    running = list(sections)
    while running:
        time.sleep(0.2)
        for section in list(running):
            done = section.proc.poll() is not None
            for record in read_records(section):
                records[record['key']] = record
                print(progress_line(record), flush=True)
            if done:
                section.code, section.ended = section.proc.returncode, time.time()
                running.remove(section)
            elif time.time() > section.deadline + KILL_GRACE_S:
                kill_group(section.proc)
                section.killed = True


def progress_line(record: Dict[str, Any]) -> str:
    """'[section] key: status', printed as each record arrives."""
    return f"[{record['section']}] {record['key'].split('/', 1)[-1]}: {record['status']}"


def fill_missing(section: Section, keys: Iterable[str], records: Dict[str, Dict[str, Any]]) -> None:
    """Rows a section did not report: skipped when it ran out of time, an error when its process failed."""
    if section.killed or section.code == 0:
        status = SKIPPED
    else:
        status = f"error: the {section.name} process exited {section.code} (logs/{section.name}.log)"
    for key in keys:
        records.setdefault(key, {'section': section.name, 'key': key, 'status': status})


def run_sections(settings: CheckSettings, preset: Preset, start: float) -> Tuple[Dict[str, Dict[str, Any]],
                                                                                  List[Section]]:
    """parity, then op, then models; each under its deadline."""
    budget, chosen = settings.budget, set(settings.sections)
    records: Dict[str, Dict[str, Any]] = {}
    done: List[Section] = []
    final = start + budget - REPORT_RESERVE_S
    for name in SECTIONS:
        if name not in chosen:
            continue
        deadline = final if name == 'models' else min(final, time.time() + preset.shares[name] * budget)
        section = start_section(settings, name, deadline)
        wait_sections([section], records)
        done.append(section)
    for section in done:
        fill_missing(section, plan_keys(section.name, preset), records)
    return records, done


def run_check(settings: CheckSettings, start: float) -> int:
    """Run the chosen sections of the resolved ``settings`` within its budget counted from ``start`` (a
    time.time()), print the progress and the tables, write the report files; 1 when a row FAILed or errored."""
    preset = settings.preset
    out = Path(settings.out)
    (out / 'logs').mkdir(parents=True, exist_ok=True)
    Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    print(f"# gpu_check on {settings.device}: sections {' '.join(settings.sections)}, budget {settings.budget:.0f} s; "
          f"logs in {out / 'logs'}", flush=True)
    records, processes = run_sections(settings, preset, start)
    text = report(records, settings, preset, processes, time.time() - start)
    print(text)
    print(f"wrote {out / 'gpu_check.md'}, {out / 'gpu_check.csv'}, {out / 'gpu_check_throughput.png'}")
    problems = failed(records)
    for line in problems:
        print(f"FAILED {line}")
    return 1 if problems else 0
