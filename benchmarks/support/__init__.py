"""Importable support code of the benchmark scripts in ``benchmarks/``, one job per module.

The scripts stay the entry points (arguments, main, report) and re-export what moved here.

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

The scripts put the repository root on ``sys.path`` and import these as ``benchmarks.support.*``.
"""
