"""Build configuration beyond pyproject.toml: the routing index's compiled core.

``engine/routing/_core.c`` (CPython C API, no other dependency) is built at install time. It is
optional: where no C compiler is available the install still succeeds and ``engine.routing``
uses its pure-Python holder maps (``engine/routing/holder_maps.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engine.routing._core",
            sources=["engine/routing/_core.c"],
            extra_compile_args=["-std=c11"],
            optional=True,
        )
    ]
)
