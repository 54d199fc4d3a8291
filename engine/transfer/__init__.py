"""Prefill -> decode KV transfer: one interface (``KVTransfer``), two backends chosen by
``transfer.backend``: ``nixl`` (UCX; DRAM or VRAM) and ``local`` (memfd shared memory, one host).

Backends are imported lazily, so hosts without NIXL can use ``local``. See ``base.py`` for the
contract, ``records.py`` for the plain data (``AgentInfo``, ``ReadRecord``, statuses) and
``nixl.py`` for measured NIXL behaviour (progress thread, failures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.transfer.base import KVTransfer
from engine.transfer.pairs import TransferError
from engine.transfer.records import DONE, FAILED, PENDING, AgentInfo, BlockPairs, ReadRecord, Role, TransferStatus

if TYPE_CHECKING:
    from configs.schema import TransferConfig

BACKENDS = ("nixl", "local")


def make_transfer(
    backend: str,
    name: str | None = None,
    *,
    role: Role = "both",
    read_timeout_s: float = 10.0,
    ucx_net_devices: str = "lo",
    **options: Any,
) -> KVTransfer:
    """A transfer object for ``backend`` ("nixl" | "local").

    ``name`` prefixes the agent name (a unique suffix is added). ``role`` says whether this
    worker's blocks are read by others ("owner", prefill), it reads others ("reader", decode),
    or both. ``ucx_net_devices`` applies to nixl only; ``options`` go to the backend's class
    (nixl: ``progress_thread``, ``progress_delay_us``).
    """
    if backend == "nixl":
        from engine.transfer.nixl import NixlTransfer

        return NixlTransfer(name, read_timeout_s=read_timeout_s, ucx_net_devices=ucx_net_devices, role=role, **options)
    if backend == "local":
        from engine.transfer.local import LocalTransfer

        return LocalTransfer(name, read_timeout_s=read_timeout_s, role=role, **options)
    raise ValueError(f"transfer.backend: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def transfer_from_config(cfg: TransferConfig, name: str | None = None, *, role: Role = "both") -> KVTransfer:
    """``make_transfer`` from the cluster config's ``transfer`` section."""
    return make_transfer(
        cfg.backend, name, role=role, read_timeout_s=cfg.read_timeout_s, ucx_net_devices=cfg.ucx_net_devices
    )


__all__ = [
    "BACKENDS",
    "DONE",
    "FAILED",
    "PENDING",
    "AgentInfo",
    "BlockPairs",
    "KVTransfer",
    "ReadRecord",
    "Role",
    "TransferError",
    "TransferStatus",
    "make_transfer",
    "transfer_from_config",
]
