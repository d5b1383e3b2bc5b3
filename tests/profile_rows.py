"""Hand-made profile rows (as linvit.bench.profile writes them) for the report and plot tests."""


def row(model, kind, size, img_per_s, mode='eager', status='ok', name=None):
    ok = status == 'ok'
    return {'model': model, 'name': name or model.replace('floor(', '').rstrip(')'), 'kind': kind, 'height': size,
            'width': size, 'tokens': (size // 16) ** 2 + 1, 'batch': 1, 'dtype': 'float32', 'mode': mode,
            'workload': 'inference', 'device': 'cpu', 'status': status, 'img_per_s': img_per_s if ok else None,
            'median_ms': 1e3 / img_per_s if ok else None,
            'peak_mem_mib': (700.0 + size) * (0.8 if kind == 'floor' else 1.0) if ok else None,
            'added_mem_mib': size / 8 if ok else None, 'threads': 2, 'machine': 'Test CPU, 2 CPUs'}


def hand_rows():
    """linvit / its floor / softmax img/s at 4 sizes; softmax runs out of memory at 2048 in compiled mode."""
    lin, fl, sm = 'linvit_small_patch16_224', 'floor(linvit_small_patch16_224)', 'vit_small_patch16_224'
    table = {224: (40., 44., 50.), 512: (10., 11., 8.), 1024: (2.5, 2.6, 1.), 2048: (0.5, 0.55, 0.05)}
    rows = []
    for size, (a, b, c) in table.items():
        rows += [row(lin, 'linvit', size, a), row(fl, 'floor', size, b), row(sm, 'softmax', size, c)]
        rows += [row(lin, 'linvit', size, 2 * a, 'compiled'), row(fl, 'floor', size, 2 * b, 'compiled'),
                 row(sm, 'softmax', size, c, 'compiled', status='oom' if size == 2048 else 'ok')]
    return rows
