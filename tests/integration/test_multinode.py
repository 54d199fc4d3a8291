"""The cluster on a real multi-node Ray on this machine (``tests/multinode_support.py``): each node
is its own ``ray start`` with its own role resources and loopback IP, the driver attaches with
``ray.address``, KV moves over NIXL (UCX on ``lo``) between workers on different nodes.

Topology (role resources decide where each worker lands; see cluster/placement.py):

    head         127.0.0.2  {prefill: 1}             GCS, the driver's raylet, the router, prefill-x
    decode node  127.0.0.3  {decode: 1}              decode-y
    doomed node  127.0.0.4  {prefill: 1, decode: 1}  one prefill and one decode worker; killed whole

Killing the doomed node leaves a prefill worker (head) and a decode worker (decode node) on two
different nodes, so the cluster must keep serving P/D over NIXL after it.

Oracles: the greedy tokens of one in-process engine on the same config (every request either
ends with exactly those tokens or with a RuntimeError naming a worker of the lost node); where
each worker runs, from the worker's own report and from the node's process tree; the free-block
counts of the surviving workers before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import itertools
import logging
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

import psutil
import pytest

from configs import ClusterConfig
from engine.sampling_params import SamplingParams
from tests.integration.conftest import GREEDY, cluster_config, oracle_tokens, random_prompts, wait_for
from tests.multinode_support import REPO_ROOT, LocalMultiNodeRay, RayNode
from tests.support import init_local_ray

pytest.importorskip("nixl")

log = logging.getLogger(__name__)

NODE_CPUS = 2  # logical CPUs per node: two 0.5-CPU workers fit on the doomed node
REQUEST_TIMEOUT_S = 180.0  # a bound on every request: a request that takes longer hung
DEATH_TIMEOUT_S = 60.0  # the GCS declares the killed node dead (health checks every second)
LOAD = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # long enough to be in flight
_node_names = itertools.count()


@pytest.fixture(scope="module")
def multinode_ray() -> Iterator[LocalMultiNodeRay]:
    """A head and a decode node for the whole module; the package's local Ray (if a test before
    started it) is shut down meanwhile and started again after."""
    import ray

    suspended = ray.get_runtime_context().namespace if ray.is_initialized() else None
    if suspended is not None:
        ray.shutdown()
    try:
        with LocalMultiNodeRay(num_cpus_per_node=NODE_CPUS) as nodes:
            nodes.add_node("head", {"prefill": 1})
            nodes.add_node("decode-node", {"decode": 1})
            try:
                yield nodes
            finally:
                disconnect()
    finally:
        if suspended is not None:
            init_local_ray(suspended)


def disconnect() -> None:
    """Drop the drivers' connection (a Cluster leaves a Ray it attached to). Driver work left
    pending that calls Ray as it is finalized would start a new local Ray in this process (see
    test_no_driver_work_left_pending_after_a_node_loss): stop such a Ray at once."""
    import ray

    with unraisable_exceptions() as stray:
        ray.shutdown()
    if ray.is_initialized():
        log.warning("a local Ray was started after the driver disconnected (%s); stopping it", stray)
        ray.shutdown()


@pytest.fixture
def doomed_node(multinode_ray: LocalMultiNodeRay) -> Iterator[RayNode]:
    """A third node offering both roles, for a test to kill (stopped after it, if it survived)."""
    node = multinode_ray.add_node(f"doomed-node-{next(_node_names)}", {"prefill": 1, "decode": 1})
    yield node
    node.stop()


def multinode_config(nodes: LocalMultiNodeRay, preset: str, num_prefill: int, num_decode: int) -> ClusterConfig:
    """``preset`` with its workers on ``nodes`` (the driver attaches by address), KV over NIXL."""
    return cluster_config(
        preset,
        num_prefill,
        num_decode,
        "transfer.backend=nixl",
        f"ray.address={nodes.address}",
        "router.work_imbalance_ratio=0",  # placement by load and prefixes only, not by earlier tests
    )


def alive_node_ips() -> set[str]:
    import ray

    return {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def worker_nodes(cluster: Any, nodes: LocalMultiNodeRay) -> dict[str, str]:
    """worker id -> the name of the node it runs on: the node whose IP the worker reports, checked
    against the node's process tree (the worker's process descends from that node's raylet)."""
    placement = {}
    by_ip = {node.ip: node for node in nodes.nodes.values()}
    for worker_id, info in cluster.infos.items():
        node = by_ip.get(info.node_ip)
        assert node is not None, f"{worker_id} reports node IP {info.node_ip}, not one of {sorted(by_ip)}"
        assert info.pid in node.pids(), f"{worker_id} (pid {info.pid}) is not a process of node {node.name}"
        placement[worker_id] = node.name
    return placement


def actor_process_titles(node: RayNode) -> list[str]:
    """The titles of ``node``'s Ray processes (``ray::Router``, ``ray::DecodeWorker``, ...)."""
    titles = []
    for proc in node.processes():
        try:
            title = " ".join(proc.cmdline()).strip()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title.startswith("ray::"):
            titles.append(title.split(" ", 1)[0].split(".", 1)[0])  # "ray::Router.route" -> "ray::Router"
    return titles


async def run_bounded(cluster: Any, prompts: Sequence[list[int]], sampling: SamplingParams, prefix: str) -> list[Any]:
    """Every prompt as its own request, concurrently, each bounded by REQUEST_TIMEOUT_S: a
    ClusterCompletion or the exception it ended with (TimeoutError: it hung)."""

    async def one(i: int, prompt: list[int]) -> Any:
        return await asyncio.wait_for(
            cluster.agenerate(prompt, sampling, request_id=f"{prefix}-{i}"), REQUEST_TIMEOUT_S
        )

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True))


def completions(results: list[Any]) -> list[Any]:
    """``results`` when every request completed (else fail, naming the first errors)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {len(results)} requests failed: {errors[:3]!r}"
    return results


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_prefill_and_decode_on_different_nodes_over_nixl(multinode_ray, preset):
    """1P+1D on two nodes (role resources put each on its own): the split requests pull their KV
    across nodes over NIXL and give the single engine's tokens."""
    from cluster.api import Cluster

    config = multinode_config(multinode_ray, preset, 1, 1)
    prompts = random_prompts(61, [70, 96, 133, 20])  # >= 64 tokens: split into prefill + decode
    expected = oracle_tokens(config, prompts)
    with Cluster(config) as cluster:
        assert len(alive_node_ips()) == 2, "a two-node Ray cluster"
        placement = worker_nodes(cluster, multinode_ray)
        assert placement == {"prefill-0": "head", "decode-0": "decode-node"}
        results = completions(asyncio.run(run_bounded(cluster, prompts, GREEDY, f"pd-{preset}")))
        assert [r.token_ids for r in results] == expected
        split = [r for r in results if r.disaggregated]
        assert len(split) >= 3 and all(r.prefill_worker == "prefill-0" for r in split)
        transfer = cluster.stats()["workers"]["decode-0"]["transfer"]
        assert transfer["reads"] >= len(split) and transfer["bytes"] > 0 and transfer["failures"] == 0


def test_losing_a_node_under_load(multinode_ray, doomed_node):
    """Kill the node holding one prefill and one decode worker while requests run: each request
    ends with the single engine's tokens or a clear error, none hangs, and the two survivors on
    the other nodes keep serving P/D over NIXL with every block back in their pools."""
    from cluster.api import Cluster

    config = multinode_config(multinode_ray, "tiny-hybrid", 2, 2)
    load = random_prompts(71, [64 + (i * 37) % 120 for i in range(24)])
    after = random_prompts(72, [70, 90, 110, 130, 150, 75])
    expected = oracle_tokens(config, load + after, LOAD)
    with Cluster(config) as cluster:
        assert len(alive_node_ips()) == 3, "a three-node Ray cluster"
        placement = worker_nodes(cluster, multinode_ray)
        doomed = sorted(w for w, node in placement.items() if node == doomed_node.name)
        survivors = sorted(set(placement) - set(doomed))
        assert [w.split("-")[0] for w in doomed] == ["decode", "prefill"], placement
        assert {placement[w] for w in survivors} == {"head", "decode-node"}, placement
        titles = {n.name: actor_process_titles(n) for n in multinode_ray.nodes.values()}
        router_nodes = [n for n, t in titles.items() if "ray::Router" in t]
        assert router_nodes == ["head"], f"the router runs beside the driver: {titles}"
        doomed_decoder = next(w for w in doomed if w.startswith("decode"))
        doomed_pids = {w: cluster.infos[w].pid for w in doomed}
        doomed_handles = {w: cluster.workers[w] for w in doomed}  # the driver may drop them
        baseline = {w: s["free_blocks"] for w, s in cluster.stats()["workers"].items()}

        async def load_then_kill() -> tuple[list[Any], list[Any], list[int]]:
            first = asyncio.ensure_future(run_bounded(cluster, load[:16], LOAD, "load"))

            async def decoding_on_doomed() -> bool:
                stats = await asyncio.wait_for(cluster.workers[doomed_decoder].stats.remote(), 30)
                return stats["running"] > 0

            deadline = asyncio.get_running_loop().time() + REQUEST_TIMEOUT_S
            while not await decoding_on_doomed():
                assert not first.done(), f"{doomed_decoder} never decoded a request of the first wave"
                assert asyncio.get_running_loop().time() < deadline, f"{doomed_decoder} never busy"
                await asyncio.sleep(0.02)
            killed = await asyncio.to_thread(doomed_node.kill)
            # requests arriving before the driver knows: routed to the dead workers, or not
            second = await run_bounded(cluster, load[16:], LOAD, "late")
            return await first, second, killed

        first, second, killed = asyncio.run(load_then_kill())
        outcomes = first + second
        assert not [r for r in outcomes if isinstance(r, TimeoutError)], "requests hung after the node died"
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, RuntimeError), f"request {i}: {outcome!r}"
                assert any(w in str(outcome) for w in doomed), f"request {i}: error names no lost worker: {outcome}"
            else:
                assert outcome.token_ids == expected[i], f"request {i} ({outcome.request_id}): wrong tokens"
        errors = [str(o).splitlines()[0] for o in outcomes if isinstance(o, BaseException)]
        log.info("node loss: %d completed, %d errors %s", len(outcomes) - len(errors), len(errors), errors[:3])

        # the node really is gone: every process of it, the workers' processes, Ray's view
        assert set(doomed_pids.values()) <= set(killed)
        assert not [pid for pid in killed if running(pid)], "a process of the killed node is still running"
        wait_for(lambda: doomed_node.ip not in alive_node_ips(), DEATH_TIMEOUT_S, "Ray to see the node dead")
        for worker_id, handle in doomed_handles.items():
            wait_for(lambda handle=handle: actor_died(handle), DEATH_TIMEOUT_S, f"Ray to report {worker_id} dead", 0.5)

        # the survivors keep serving, split across their two nodes, the same tokens
        decoder = next(w for w in survivors if w.startswith("decode"))
        reads_before = cluster.stats()["workers"][decoder]["transfer"]["reads"]
        results = completions(asyncio.run(run_bounded(cluster, after, LOAD, "after")))
        assert [r.token_ids for r in results] == expected[len(load) :]
        assert {w for r in results for w in (r.prefill_worker, r.decode_worker)} <= set(survivors)
        split = [r for r in results if r.disaggregated]
        assert split, "P/D between the head and the decode node"
        assert cluster.stats()["workers"][decoder]["transfer"]["reads"] >= reads_before + len(split)

        def back_to_baseline() -> bool:
            workers = cluster.stats()["workers"]
            return all(workers[w]["free_blocks"] == baseline[w] and workers[w]["running"] == 0 for w in survivors)

        wait_for(back_to_baseline, 30, "the surviving workers' free blocks back to their baseline")


@contextlib.contextmanager
def unraisable_exceptions() -> Iterator[list[str]]:
    """Exceptions Python could not raise (a coroutine left pending that fails as it is finalized,
    say) while the block runs and in a garbage collection after it."""
    seen: list[str] = []
    previous = sys.unraisablehook

    def record(unraisable: Any) -> None:
        seen.append(f"{unraisable.object!r}: {unraisable.exc_type.__name__}: {unraisable.exc_value}")
        log.error("unraisable: %s", seen[-1])

    sys.unraisablehook = record
    try:
        yield seen
        gc.collect()
    finally:
        sys.unraisablehook = previous


def pending_driver_coroutines() -> list[str]:
    """Coroutines of the driver's code (cluster/) that were started and never finished."""
    driver_dir = str(REPO_ROOT / "cluster")
    return sorted(
        obj.cr_code.co_qualname
        for obj in gc.get_objects()
        if type(obj) is types.CoroutineType  # not isinstance: no __class__ lookups on every object
        and obj.cr_code.co_filename.startswith(driver_dir)
        and inspect.getcoroutinestate(obj) == inspect.CORO_SUSPENDED
    )


def test_no_driver_work_left_pending_after_a_node_loss(multinode_ray, doomed_node):
    """After a node is lost and the driver has noticed, ``Cluster.shutdown()`` ends all of the
    driver's work: no coroutine of it stays suspended (it would run on after, or call Ray as it
    is finalized)."""
    from cluster.api import Cluster

    with Cluster(multinode_config(multinode_ray, "tiny", 2, 2)) as cluster:
        doomed = [w for w, node in worker_nodes(cluster, multinode_ray).items() if node == doomed_node.name]
        assert len(doomed) == 2
        doomed_node.kill()

        def noticed() -> bool:
            health = cluster.health()
            return all(health[w].startswith("lost") for w in doomed)

        wait_for(noticed, DEATH_TIMEOUT_S, "the driver to notice the lost workers", 0.5)
    assert not pending_driver_coroutines()


def test_the_router_cpu_is_counted():
    """The router asks for a sliver of a CPU (so that Ray starts it on the driver's node rather
    than on any node): a cluster the workers alone fill exactly is refused with a clear error."""
    from cluster.placement import ROUTER_NUM_CPUS, PlacementError, check_capacity

    config = cluster_config("tiny", 2, 2)  # 4 workers x 0.5 CPU
    assert ROUTER_NUM_CPUS > 0
    refused = r"the workers need 2 CPU and the router replicas 0.01 beside them .* has 2"
    with pytest.raises(PlacementError, match=refused):
        check_capacity(config, {"CPU": 2.0, "prefill": 2.0, "decode": 2.0})
    check_capacity(config, {"CPU": 3.0, "prefill": 2.0, "decode": 2.0})


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def actor_died(handle: Any) -> bool:
    """Whether Ray reports the actor dead (not merely unreachable for now)."""
    import ray
    from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

    try:
        ray.get(handle.health.remote(), timeout=10)
    except ActorDiedError:
        return True
    except (RayActorError, GetTimeoutError):  # unavailable: the GCS has not declared it dead yet
        return False
    return False
