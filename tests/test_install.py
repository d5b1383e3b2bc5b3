"""The installed package is the one Python imports, wherever a script starts.

A clone is usually named ``linvit``, so a script or ``python -c`` run from the clone's parent folder has a folder
``linvit/`` (the repository, no ``__init__.py``) in its working directory. Python's path scan takes that folder as
an empty namespace package unless the regular package ``linvit/linvit/__init__.py`` is found on ``sys.path`` in the
same scan; setuptools' default editable install for a flat layout exposes the package through a finder that is
asked only after that scan, so ``import linvit`` gave an empty module and timm knew no ``linvit_*`` model.
pyproject.toml's ``package-dir`` makes every editable install put the repository root on ``sys.path`` instead.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import linvit

pytestmark = pytest.mark.integration  # trains or starts interpreters

ROOT = Path(__file__).resolve().parents[1]
IMPORT_CHECK = "import linvit, timm; print(linvit.__file__); print(timm.is_model('linvit_tiny_patch16_224'))"


def test_a_script_beside_a_clone_named_linvit_imports_the_package(tmp_path):
    (tmp_path / 'linvit').symlink_to(ROOT, target_is_directory=True)
    env = {key: value for key, value in os.environ.items() if key != 'PYTHONPATH'}  # the install alone, as users run
    result = subprocess.run([sys.executable, '-c', IMPORT_CHECK], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    file, registered = result.stdout.split()
    assert file != 'None', "imported the clone's folder as an empty namespace package"
    assert Path(file).resolve() == Path(linvit.__file__).resolve()
    assert registered == 'True'
