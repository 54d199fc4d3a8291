"""Importable support code of the benchmark scripts in ``benchmarks/``, one job per module.

The scripts stay the entry points (arguments, main, report) and re-export what moved here.

``benchmarks/kv_cache_vs_vllm.py``:

- ``kv_trace``: drive.py's trace parameters, the retention configurations, the trace and groups.
- ``kv_replay``: kvfleet's replay of drive.py's scheduling loop (``TraceRunner``) and its medians.
- ``vllm_anchor``: vLLM's KVCacheManager through the anchor's drive.py (``VllmAnchor``).

The scripts put the repository root on ``sys.path`` and import these as ``benchmarks.support.*``.
"""
