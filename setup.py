"""Build configuration beyond pyproject.toml: the routing index's compiled core and the host
tier's row copies.

``engine/routing/_core.c`` (CPython C API, no other dependency) is built at install time. It is
optional: where no C compiler is available the install still succeeds and ``engine.routing``
uses its pure-Python holder maps (``engine/routing/holder_maps.py``); ``engine/routing/_load.c``
likewise (without it, the policy's load book is ``engine.routing.load.PyLoadBook``), and
``engine/routing/_inflight.c`` (else ``engine.routing.inflight.PyInFlightPrefixes``) and
``engine/routing/_reuse.c`` (else ``engine.routing.prefix_reuse.PrefixReuse``). ``engine/_row_copy.c`` is
optional the same way: without it ``engine.host_kv`` copies rows with numpy.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engine.routing._core",
            sources=["engine/routing/_core.c"],
            extra_compile_args=["-std=c11"],
            optional=True,
        ),
        Extension(
            "engine.routing._load",
            sources=["engine/routing/_load.c"],
            # no fused multiply-add: the book's arithmetic must round like PyLoadBook's
            extra_compile_args=["-std=c11", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "engine.routing._reuse",
            sources=["engine/routing/_reuse.c"],
            # no fused multiply-add: the counts must round like prefix_reuse.PrefixReuse's
            extra_compile_args=["-std=c11", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "engine.routing._inflight",
            sources=["engine/routing/_inflight.c"],
            extra_compile_args=["-std=c11"],
            optional=True,
        ),
        Extension("engine._row_copy", sources=["engine/_row_copy.c"], extra_compile_args=["-std=c11"], optional=True),
    ]
)
