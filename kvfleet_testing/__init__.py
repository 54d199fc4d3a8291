"""Harnesses the tests and the benchmarks share; neither a product package nor part of ``tests/``.

Owns, one job per module:

- ``workloads``: every seeded shared-prefix prompt mix in token ids, and a prompt order's
  unbounded-cache hit rate (``hit_rate_bound``);
- ``sizing``: a cluster config whose pools are sized for a workload (``sized_config``);
- ``presets``: a preset on the test device (``load_preset``), a P/D cluster shape
  (``cluster_config``) and the fast health-check overrides (``FAST_HEALTH``);
- ``ports``: a free loopback port (``free_port``);
- ``kv_cache_sim``: the simulated scheduler driving ``HybridCoordinator`` with its oracle checks
  (the hypothesis state machine's and ``benchmarks/kv_cache_fuzz.py``'s);
- ``pd_harness``: prefill/decode engine pairs under adversarial interleavings, checked against
  each prompt run alone;
- ``pd_stress``: the same on a local Ray cluster with busy cores;
- ``chaos``: kills of workers and the router under steady load, every request checked.

Invariants: nothing here imports ``tests`` or ``benchmarks``; product packages never import this.
It is not installed with the product (pyproject's ``packages.find`` leaves it out, so the wheel and
the image hold only the product packages): import it from the repository root, where pytest and
``python -m benchmarks.<name>`` run.
"""
