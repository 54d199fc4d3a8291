"""Process-wide test settings: keep Ray and UCX on loopback and offline."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The Triton kernels (engine/model/triton_*.py) are tested under Triton's interpreter where there
# is no GPU. Triton reads TRITON_INTERPRET when its language module is first imported, and test
# modules import transformers' modeling code at collection time, which may import triton first:
# so it is set here, before any test module is collected.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# The suite runs on two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadgroup
# --no-loadscope-reorder``). The tests that start Ray clusters (these packages: their fixtures are
# package- and module-scoped clusters and Serve apps, and their timeouts assume no second cluster
# beside them) are one work unit, run in order on one worker and first, so that worker starts on
# them at once; every other test file is a unit of its own, so module fixtures are built once,
# and the other worker takes them in collection order. ``-n 0`` runs everything in one process
# in the same order.
CLUSTER_PACKAGES = ("tests/integration/", "tests/serve/")
CLUSTER_UNIT = "ray-clusters"


def work_unit(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    return CLUSTER_UNIT if path.startswith(CLUSTER_PACKAGES) else path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: work_unit(item) != CLUSTER_UNIT)  # stable: collection order within
    for item in items:
        item.add_marker(pytest.mark.xdist_group(work_unit(item)))
