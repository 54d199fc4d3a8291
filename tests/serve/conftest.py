"""A live kvfleet HTTP API for the serve tests: one local Ray, Ray Serve's proxy on a free
loopback port, and two applications on it.

* ``main`` (route ``/``): tiny Gemma3 (sliding window + full attention), 1 prefill + 1 decode
  worker over the local transfer backend, prompts from 16 tokens split P/D, an API key.
* ``small`` (route ``/small``): tiny Bamba (Mamba2 hybrid), 1 prefill + 1 decode worker, a queue
  bound of 2 requests per ingress replica; its decode worker is killed by the last health test.
* ``bytes`` (route ``/bytes``, deployed by the first test that asks for it): a tiny random Llama
  with a SentencePiece-style byte-fallback tokenizer (``tests/serve/byte_tokenizers.py``), one
  decode worker, the API key.

Both are deployed with ``serving.app.kvfleet_app``, the application ``serve run`` and the
RayService deploy. The Ray fixture is scoped to this package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from configs import ClusterConfig, load_config
from kvfleet_testing.ports import free_port
from tests.support import init_local_ray, wait_for  # noqa: F401  (re-exported)

API_KEY = "test-key-" + "5f1c2e"
MAIN_ROUTE = ""
SMALL_ROUTE = "/small"
BYTES_ROUTE = "/bytes"
SMALL_QUEUE_BOUND = 2


@dataclass(frozen=True)
class Server:
    """One deployed application: where it answers and the config it runs."""

    base: str  # http://127.0.0.1:PORT[/route]
    config: ClusterConfig
    app_name: str
    api_key: str | None

    @property
    def model(self) -> str:
        return self.config.serve.served_model_name or self.config.model.source

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kwargs: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_openai(self, **kwargs: Any) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.base}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", headers=self.headers(), timeout=60, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        return httpx.post(f"{self.base}{path}", headers=headers, timeout=60, **kwargs)

    def totals(self) -> dict[str, Any]:
        response = self.get("/v1/stats")
        assert response.status_code == 200, response.text
        return response.json()["totals"]

    def controller_handles(self) -> Any:
        from ray import serve

        from serving.app import CONTROLLER

        return serve.get_deployment_handle(CONTROLLER, app_name=self.app_name).handles.remote().result()


def main_config() -> ClusterConfig:
    return load_config(
        "tiny",
        [
            "router.decode_only_threshold_tokens=16",
            "router.work_imbalance_ratio=0",
            f"serve.api_key={API_KEY}",
            "serve.max_queued_requests=128",
        ],
    )


def small_config() -> ClusterConfig:
    return load_config(
        "tiny-hybrid", [f"serve.max_queued_requests={SMALL_QUEUE_BOUND}", "serve.served_model_name=tiny-bamba-small"]
    )


@pytest.fixture(scope="package")
def servers() -> Iterator[dict[str, Server]]:
    import ray
    from ray import serve

    from serving.app import kvfleet_app

    init_local_ray("kvfleet-serve-tests")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        root = f"http://127.0.0.1:{port}"
        main, small = main_config(), small_config()
        serve.run(kvfleet_app(main), name="main", route_prefix="/", blocking=False)
        serve.run(kvfleet_app(small), name="small", route_prefix=SMALL_ROUTE, blocking=False)
        yield {
            "main": Server(root + MAIN_ROUTE, main, "main", API_KEY),
            "small": Server(root + SMALL_ROUTE, small, "small", None),
        }
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="package")
def byte_server(servers: dict[str, Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The ``bytes`` application, on the same Serve instance as the others."""
    from ray import serve

    from serving.app import kvfleet_app
    from tests.serve.byte_tokenizers import byte_fallback_llama

    directory = byte_fallback_llama(tmp_path_factory.mktemp("byte-fallback-llama"))
    config = load_config(
        "tiny",
        [
            f"model.source={directory}",
            "workers.num_prefill=0",
            "serve.served_model_name=tiny-byte-fallback",
            f"serve.api_key={API_KEY}",
        ],
    )
    serve.run(kvfleet_app(config), name="bytes", route_prefix=BYTES_ROUTE, blocking=False)
    root = servers["main"].base.removesuffix(MAIN_ROUTE)
    return Server(root + BYTES_ROUTE, config, "bytes", API_KEY)


@pytest.fixture(scope="package")
def server(servers: dict[str, Server]) -> Server:
    return servers["main"]


@pytest.fixture(scope="package")
def small_server(servers: dict[str, Server]) -> Server:
    return servers["small"]


def server_log_files() -> dict[Path, int]:
    """This Ray session's log files and their sizes now: Serve's replica logs and the actors'
    stdout and stderr (where asyncio reports a task error nobody retrieved)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [*logs.glob("serve/*.log"), *logs.glob("worker-*.err"), *logs.glob("worker-*.out")]
    return {f: f.stat().st_size for f in files if f.is_file()}


def logged_since(sizes: dict[Path, int]) -> str:
    """What the session's processes logged after ``server_log_files()`` returned ``sizes``."""
    text = []
    for path in server_log_files():
        with path.open("rb") as f:
            f.seek(sizes.get(path, 0))
            text.append(f.read().decode(errors="replace"))
    return "".join(text)


def all_blocks_free(server: Server) -> Callable[[], bool]:
    """True once nothing runs, waits or is held for a transfer, and every block of every worker
    is back in its pool (cached blocks count as free)."""

    def check() -> bool:
        totals = server.totals()
        return (
            totals["running"] == 0
            and totals["queued"] == 0
            and totals["held_for_transfer"] == 0
            and totals["free_blocks"] == totals["num_blocks"]
        )

    return check
