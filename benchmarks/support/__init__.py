"""Importable support code of the benchmark scripts in ``benchmarks/``, one job per module.

The scripts stay the entry points (arguments, main, report); what they share lives here.

``benchmarks/kv_cache_vs_vllm.py``:

- ``kv_trace``: drive.py's trace parameters, the retention configurations, the trace and groups.
- ``kv_replay``: kvfleet's replay of drive.py's scheduling loop (``TraceRunner``) and its medians.
- ``vllm_anchor``: vLLM's KVCacheManager through the anchor's drive.py (``VllmAnchor``).

``benchmarks/routing_sim.py``:

- ``routing_trace``: the workers' KV groups, the shared prefixes and one scenario's trace.
- ``routing_workers``: a simulated worker (``SimWorker``) and the jobs it serves (``Job``).
- ``routing_simulation``: the discrete-event simulation of one policy over one trace (``Simulation``).
- ``routing_results``: per-request records and one run's metrics (``Record``, ``Result``).

``benchmarks/hybrid_capacity.py``:

- ``hybrid_models``: the models' published shapes, their ``ModelArch`` and vLLM's block for them.
- ``hybrid_layouts``: cacheable prefix tokens per layout (ideal, padded, vLLM unified, kvfleet).
- ``hybrid_hits``: the shared-prefix hit sweep through the real scheduler, both layouts.

``benchmarks/serve_bench.py``:

- ``serve_workload``: the shared-prefix request mix in text, its prompts and the sized pools.
- ``serve_server``: ``kvfleet serve`` as a subprocess on a free loopback port (``Server``).
- ``serve_http``: the HTTP client: GETs, ``/v1/stats`` and one streamed completion timed.
- ``serve_loadgen``: guidellm, found, its version checked against the pin, and one run of it.
- ``serve_results``: one guidellm report summarized (TTFT, latency, hit rate, losses).
- ``serve_runs``: one policy at one rate, and HTTP TTFT against the driver API's (``Bench``).

``benchmarks/cluster_bench.py``:

- ``cluster_runs``: one routing policy on a fresh cluster, every policy in turn, the ratios (``run_bench``).
- ``cluster_suite``: the whole cluster benchmark and its summary keys (``Suite``, ``run_suite``).
- ``repin``: a pin re-established by copy against by compute on two prefill workers (``measure_repin``).
- ``route_replay``: the prompts replayed through real coordinators under each placement (``Replay``);
  ``benchmarks/route_ceiling.py`` runs it over a grid of workloads.

Every script: ``stats``, the one ``percentile``.

``benchmarks/engine_vs_hf.py`` and ``benchmarks/engine_gpu.py``:

- ``hf_generate``: the mixed-length request mix and Hugging Face ``generate`` over it in left-padded batches.

``benchmarks/engine_gpu.py``:

- ``gpu_bench_setup``: the models' shapes, the run's sizes, one run's state (``Run``) and its checkpoints.
- ``gpu_bench_decode``: the decode step's time and the bytes it must read, against the copy bandwidth.

The scripts run as ``python -m benchmarks.<name>`` from the repository root and import these as
``benchmarks.support.*``; the workloads and harnesses the tests use too are in ``kvfleet_testing``.
"""
