"""linvit.bench.plots: one PNG per (workload, dtype, batch), sizes labelled in pixels and tokens, plain log labels."""
from pathlib import Path

from profile_rows import hand_rows

from linvit.bench import plots, report

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def test_close_sizes_get_their_tick_labels_one_below_the_other():
    assert plots.staggered({224.0: 'a', 495.8: 'b', 512.0: 'c', 540.0: 'd', 1024.0: 'e'}) == [
        'a', 'b', '\n\nc', 'd', 'e']


def test_plot_writes_one_png_per_workload_dtype_batch(tmp_path):
    paths = plots.plot(hand_rows(), str(tmp_path))
    assert [Path(p).name for p in paths] == ['profile_inference_float32_b1.png']
    assert Path(paths[0]).read_bytes()[:8] == PNG_MAGIC


def test_plot_labels_sizes_in_pixels_and_tokens_with_the_legend_outside():
    group = [r for r in report.aggregate_rounds(hand_rows()) if r['status'] == 'ok']
    fig = plots.throughput_figure(group)
    ax_speed, ax_mem, ax_peak = fig.axes
    fig.canvas.draw()
    for ax in (ax_speed, ax_mem, ax_peak):
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            '224 px\n197 tok', '512 px\n1,025 tok', '1024 px\n4,097 tok', '2048 px\n16,385 tok']
        assert ax.get_legend() is None
        y_labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
        assert y_labels and not any('10^' in t or 'e-' in t or 'e+' in t for t in y_labels)
    assert ax_speed.get_yscale() == 'log' and 'added by the forward' in ax_mem.get_ylabel()
    [mem_line] = [line for line in ax_mem.get_lines() if line.get_label() == 'vit_small_patch16_224 [eager]']
    assert list(mem_line.get_ydata()) == [224 / 8, 512 / 8, 1024 / 8, 2048 / 8]  # added_mem_mib, not the peak
    [legend] = fig.legends  # one legend, below the panels: models left, their floors right, mode markers last
    assert [t.get_text() for t in legend.get_texts()] == [
        'linvit_small_patch16_224', 'vit_small_patch16_224', 'eager',
        'floor(linvit_small_patch16_224)', '', 'compiled']
    title = fig._suptitle.get_text()
    assert title.startswith('inference, float32, batch 1, eager and compiled') and 'Test CPU, 2 CPUs' in title

