"""The types of the Ray actor handles the driver holds.

Typed ``Any`` on purpose: ray.actor.ActorHandle declares ``__getattr__`` as returning Never, so
mypy would treat every line after a remote call as unreachable and check none."""

from typing import Any

WorkerHandle = Any  # a started actors.worker.PrefillWorker or DecodeWorker
RouterHandle = Any  # the started actors.router.Router
