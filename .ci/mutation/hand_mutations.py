"""The seven hand mutations of issue 12, kept as a check: apply each, run its test files, print the result, restore.

    .venv/bin/python .ci/mutation/hand_mutations.py   (from the repository root; every line should say "failed")
"""
import subprocess
from pathlib import Path

MUTATIONS = [
    ('eps * N -> eps (unmasked)', 'linvit/ops/linear_attn/pytorch.py',
     'return out1[..., :dv] / (out1[..., dv:] + eps * count)', 'return out1[..., :dv] / (out1[..., dv:] + eps)',
     'tests/ops/test_linear_attention.py'),
    ("elu1 '+ r' -> '+ x'", 'linvit/ops/feature_maps.py', 'return torch.exp(x - r) + r', 'return torch.exp(x - r) + x',
     'tests/ops/test_linear_attention.py'),
    ('local mix reflect padding', 'linvit/layers/local_mix.py', 'padding=kernel_size // 2, groups=channels,',
     "padding=kernel_size // 2, padding_mode='reflect', groups=channels,", 'tests/layers'),
    ('convert: norm not moved', 'linvit/models/convert.py',
     "_SHARED_SUBMODULES = ('qkv', 'q_norm', 'k_norm', 'norm', 'gate', 'proj', 'proj_drop')",
     "_SHARED_SUBMODULES = ('qkv', 'q_norm', 'k_norm', 'gate', 'proj', 'proj_drop')",
     'tests/models/test_convert_values.py tests/models/test_convert_to_linear.py'),
    ('layer: self.norm(out) -> out', 'linvit/layers/linear_attention.py', 'out = self.norm(out)', 'out = out',
     'tests/layers/test_linear_attention_layer.py'),
    ('layer: gate without sigmoid', 'linvit/layers/linear_attention.py', 'out = out * self.gate(x).sigmoid()',
     'out = out * self.gate(x)', 'tests/layers/test_linear_attention_layer.py'),
    ('convert: mode not copied', 'linvit/models/convert.py', 'return linear.train(attn.training)', 'return linear',
     'tests/models/test_convert_values.py tests/models/test_convert_to_linear.py'),
]
for label, path, old, new, tests in MUTATIONS:
    p = Path(path)
    source = p.read_text()
    assert source.count(old) == 1, (label, old)
    p.write_text(source.replace(old, new))
    try:
        r = subprocess.run(f'.venv/bin/pytest -q -p no:cacheprovider -m "not compiler" {tests}', shell=True,
                           capture_output=True, text=True)
        print(f'{label}: {r.stdout.strip().splitlines()[-1]}', flush=True)
    finally:
        p.write_text(source)
