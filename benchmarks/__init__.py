"""kvfleet's benchmarks: each script here runs from the repository root as
``python -m benchmarks.<name>`` and prints one JSON object as its last stdout line
(``benchmarks/README.md`` has the latest numbers). Not installed with the product packages, which
never import it; the harnesses it shares with the tests live in ``kvfleet_testing``.
"""
