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
from xdist.scheduler import LoadScopeScheduling

# The suite runs on two pytest-xdist workers (pyproject's addopts: ``-n 2 --no-loadscope-reorder``).
# The tests that start Ray clusters (tests/integration/: package- and module-scoped clusters whose
# timeouts assume no second cluster of theirs beside them) are one work unit, run in order on one
# worker and first, so that worker starts on them at once; every other test file is a unit of its
# own, so its module fixtures are built once, and the other worker takes those units in collection
# order. The Serve tests (tests/serve/: one package-scoped cluster with two Serve apps) are one unit
# too, queued last: the other worker reaches it while the first still runs the cluster unit (that
# unit took about 1,600 s of a CI run, all the others together about 1,000 s, Serve's 260 s of
# them), so the two clusters overlap only for the Serve unit's minutes. ``-n 0`` runs everything in
# one process in the same order.
CLUSTER_PACKAGES = ("tests/integration/",)
CLUSTER_UNIT = "ray-clusters"
SERVE_PACKAGES = ("tests/serve/",)
SERVE_UNIT = "ray-serve"


def work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path.startswith(CLUSTER_PACKAGES):
        return CLUSTER_UNIT
    return SERVE_UNIT if path.startswith(SERVE_PACKAGES) else path


class ByWorkUnit(LoadScopeScheduling):
    """xdist's scope scheduling (a unit goes whole to one worker, in order) with ``work_unit``'s
    units in place of its per-module scopes."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ByWorkUnit:
    return ByWorkUnit(config, log)  # type: ignore[arg-type]  # xdist types log as its Producer


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {CLUSTER_UNIT: 0, SERVE_UNIT: 2}
    items.sort(key=lambda item: order.get(work_unit(item.nodeid), 1))  # stable: collection order within
