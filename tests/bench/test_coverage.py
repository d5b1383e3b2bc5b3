"""The coverage table of docs/models.md ("Which timm ViTs convert") says what ``tools/vit_coverage.py`` finds.

The cheap columns (models, converts, runs, the representative and the reasons) are recomputed here for every model
of every surveyed family and must equal the written table; the compile and ONNX cells are recomputed for one family
(eva: rotary attention through inductor and the ONNX exporter). A model that stops converting, a new timm model or
a changed refusal message makes this fail until the table is regenerated (``python tools/vit_coverage.py
--write-docs``).
"""
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import timm

from linvit.bench import coverage

ROOT = Path(__file__).resolve().parents[2]
#: the family whose compile and ONNX cells are recomputed (the others are written by the tool only)
CHECKED_FAMILY = 'eva'
CHEAP_COLUMNS = ('models', 'converts', 'runs', 'checked on', 'why not')


def _load_tool() -> ModuleType:
    """tools/vit_coverage.py as a module (tools are scripts, not package modules): its ONNX check."""
    spec = importlib.util.spec_from_file_location('vit_coverage', ROOT / 'tools' / 'vit_coverage.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def found():
    """(family rows, model rows) of the cheap columns, every model of every surveyed family."""
    return coverage.survey(coverage.FAMILIES, family_checks={})


@pytest.fixture(scope='module')
def written():
    return coverage.parse_markdown(coverage.read_block((ROOT / 'docs' / 'models.md').read_text(encoding='utf-8')))


def test_the_table_has_one_row_per_surveyed_family_in_order(written):
    assert list(written) == list(coverage.FAMILIES)


def test_the_converts_runs_and_reason_cells_are_what_the_tool_finds(found, written):
    families, _ = found
    differences = [f"{row.family} {column}: docs say {written[row.family][column]!r}, the tool finds "
                   f"{coverage.cells(row)[column]!r}"
                   for row in families for column in CHEAP_COLUMNS
                   if written[row.family][column] != coverage.cells(row)[column]]
    assert not differences, "regenerate with python tools/vit_coverage.py --write-docs:\n" + '\n'.join(differences)


def test_every_model_is_counted_and_every_failure_has_a_reason(found):
    families, models = found
    for row in families:
        assert row.models == len(timm.list_models(module=row.family)) == sum(m.family == row.family for m in models)
    assert all(m.reason for m in models if not m.runs)
    assert all(m.reason.startswith('does not build at tiny depth: ') for m in models if not m.built)


def test_every_eva_model_converts_and_loads_its_softmax_checkpoint(found):
    _, models = found
    eva = [m for m in models if m.family == 'eva']
    assert len(eva) == len(timm.list_models(module='eva')) == 65
    assert [m.name for m in eva if not (m.built and m.converts)] == []
    assert [m.name for m in eva if not m.runs] == []


def test_a_per_block_model_converts_with_its_checkpoint_keys():
    """Sapiens2 takes one key/value head count per block: built at tiny depth from its full model's entries, its
    softmax state dict loads strictly into the converted model and the keys stay."""
    model = coverage.build_tiny('vit_base_patch16_sapiens2')
    softmax = {key: value.clone() for key, value in model.state_dict().items()}
    linear = coverage.convert_to_linear(model)
    assert set(linear.state_dict()) == set(softmax)
    linear.load_state_dict(softmax, strict=True)


def test_a_failing_conversion_is_counted_with_its_reason(monkeypatch):
    def broken(model):
        raise ValueError("broken on purpose")
    monkeypatch.setattr(coverage, 'convert_to_linear', broken)
    row, models = coverage.check_family('deit', names=['deit_tiny_patch16_224', 'deit_small_patch16_224'])
    assert coverage.cells(row)['converts'] == '0/2' and row.representative is None
    assert coverage.cells(row)['why not'] == '2 x broken on purpose'


def test_the_compile_and_onnx_cells_of_one_family(found, written):
    families, _ = found
    representative = next(row.representative for row in families if row.family == CHECKED_FAMILY)
    checks = {'compiles': coverage.compiles, 'ONNX': _load_tool().exports_to_onnx}
    row, _ = coverage.check_family(CHECKED_FAMILY, family_checks=checks, names=[representative])
    for column in checks:
        assert written[CHECKED_FAMILY][column] == coverage.cells(row)[column] == 'yes'
