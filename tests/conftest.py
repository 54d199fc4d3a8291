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
