"""Benchmarks and profiling as a library: what ``tools/bench_*.py``, ``tools/profile_*.py``, ``tools/gpu_check.py`` and
``tools/quality_check.py`` run. The tools only parse their command line and call these modules; nothing here is
imported by ``import linvit``. Timing itself (interleaved medians, percentiles, CSV rows) is the leaf ``linvit.timing``,
which the engine and the export share.

    cli        HelpFormatter (every option shows its default), crossover of two speed curves, --dtype parsing,
               --threads (auto: the free cores) and the busy-machine warning, the missing-CUDA-device exit
    specs      model specs 'name:key=value,...' (ModelSpec), image sizes 'N' or 'HxW', MODES, WORKLOADS
    memory     MemoryWatch (peak memory of timed calls, CPU RSS or CUDA allocations), the allocator setting
    machine    describe_machine: 'NVIDIA H200' or 'AMD EPYC ..., 2 CPUs'
    plots      throughput / memory figures against image size (matplotlib's object API, no pyplot), plain_log_y
    report     profile rows: CSV columns, rounds merged, printed tables, failures
    tables     markdown tables of the GPU and quality checks' reports
    processes  child processes under deadlines (killed with their process group), the parent's age
    profile    profile_resolution's sweep: one process per configuration (Config, measure, run_config, sweep)
    profile_cli  the sweep's command line, shared by tools/profile_resolution.py and tools/profile_forward.py
    attention  one attention layer: softmax vs linear vs the floor (bench_attention)
    causal     causal linear attention's forms (bench_causal)
    train_step whole-model training steps, interleaved (bench_train_step)
    gpu_check/ the GPU check: plan, sections (each its own process), runner, report (tools/gpu_check.py)
    quality/   linvit against softmax ViTs trained through the engine at high resolution: plan, recipe, job (a run's
               process), data, probe, runner, results, report (tools/quality_check.py)
    data       input-pipeline throughput, per-image against cached, against the model's step (tools/bench_data.py)
    op_overhead, kernel_report  the attention op's host overhead and its GPU kernels (tools/bench_op_overhead.py,
               tools/kernel_report.py)
    coverage   which timm ViTs convert_to_linear converts, runs, compiles and exports (tools/vit_coverage.py)
"""
