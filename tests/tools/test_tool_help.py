"""Every option of every tool explains itself in --help and shows its default."""
import argparse

import pytest
from conftest import load_tool


@pytest.fixture(scope='module')
def parsers(bench, prof, forward, export_tool, predict_tool, causal_bench, context_demo_tool):
    return {'bench_attention': bench.build_parser(), 'profile_resolution': prof.build_parser(),
            'profile_forward': forward.build_parser(), 'export_onnx': export_tool.build_parser(),
            'predict': predict_tool.build_parser(), 'bench_causal': causal_bench.build_parser(),
            'kernel_report': load_tool('kernel_report').build_parser(),
            'bench_op_overhead': load_tool('bench_op_overhead').build_parser(),
            'quality_check': load_tool('quality_check').build_parser(),
            'bench_data': load_tool('bench_data').build_parser(),
            'vit_coverage': load_tool('vit_coverage').build_parser(),
            'export_hub': load_tool('export_hub').build_parser(),
            'context_demo': context_demo_tool.build_parser()}


def _options(parser):
    return [a for a in parser._actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def test_every_option_has_help_that_shows_its_default(parsers):
    for tool, parser in parsers.items():
        formatter = parser.formatter_class(tool)
        for action in _options(parser):
            name = f"{tool} {(action.option_strings or [action.dest])[0]}"
            assert action.help and action.help.strip(), f"{name} has no help"
            shown = formatter._get_help_string(action) % {'default': action.default, 'prog': tool}
            if action.default is not None:  # options without a default say what not giving them means
                assert '(default: ' in shown, f"{name}: {shown!r} does not show its default"
        assert parser.format_help()  # every help string survives argparse's %-formatting


def test_defaults_are_written_plainly(parsers):
    by_option = {a.option_strings[0]: a for a in _options(parsers['profile_resolution'])}
    formatter = parsers['profile_resolution'].formatter_class('profile_resolution')
    assert formatter._get_help_string(by_option['--dtype']).endswith('(default: float32)')
    assert formatter._get_help_string(by_option['--mode']).endswith('(default: eager compiled)')
    assert formatter._get_help_string(by_option['--sizes']).endswith('(default: 224 512 1024 2048)')
    assert formatter._get_help_string(by_option['--retain-freed-memory']).endswith(
        '(default: the system allocator settings)')
    assert by_option['--timeout'].help.endswith("before it is stopped and recorded as 'timeout'")
    bench_options = {a.option_strings[0]: a for a in _options(parsers['bench_attention'])}
    bench_formatter = parsers['bench_attention'].formatter_class('bench_attention')
    assert bench_formatter._get_help_string(bench_options['--compile']).endswith('(default: off)')
