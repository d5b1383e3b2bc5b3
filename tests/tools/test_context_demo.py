"""tools/context_demo.py on a tiny trained run of the shapes task: both ways printed, the pictures written, and its
whole-image mIoU equal to the one train.py's own evaluation wrote (seg.eval.mode=whole), an independent path."""
import json
import re

import pytest

pytestmark = [pytest.mark.compiler, pytest.mark.integration]  # integration: trains or starts interpreters


def test_whole_and_windows_are_scored_and_drawn(seg_run, context_demo_tool, capsys):
    assert context_demo_tool.main(['--run', str(seg_run), '--pictures', '2']) == 0
    printed = capsys.readouterr().out
    found = dict(re.findall(r'^\s+(whole image|sliding windows of 16 px every 8 px)\s+mIoU (\d\.\d{3})', printed,
                            re.MULTILINE))
    assert set(found) == {'whole image', 'sliding windows of 16 px every 8 px'}
    miou = json.loads((seg_run / 'metrics.json').read_text())['miou']
    assert float(found['whole image']) == pytest.approx(miou, abs=5e-4)
    for name in ('context_whole.png', 'context_windows.png'):
        assert (seg_run / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
