"""A ``gloo`` checkpoint engine for verl 0.9.1: the trainer's weights to standalone rollout replicas
over TCP, on machines without an accelerator and across Ray nodes.

verl's ``separate_async`` trainer moves weights with a checkpoint engine
(``verl/checkpoint_engine/base.py``: the abstract ``CheckpointEngine``, driven for one sync by
``CheckpointEngineManager.update_weights``). The shipped backends need a GPU or RDMA, and ``naive``
is in-process only. This one is registered as ``gloo`` in verl's ``CheckpointEngineRegistry`` when
``verl.checkpoint_engine.base`` is imported, by importing this module (:mod:`otb_tir.verl.cpu`
does, in every process of a CPU run; ``checkpoint_engine.custom_backend_module`` naming this module
would too). Select it with ``actor_rollout_ref.rollout.checkpoint_engine.backend=gloo``; options go
in ``checkpoint_engine.engine_kwargs.gloo`` (``timeout_s``; ``host``: the address of the actor's rank
0, where the store listens, default Ray's node address; verl hands the same options to every
member, so the others bind their own address on the route to it, never ``host``).

One sync, as verl drives it (``update_weights`` → ``build_process_group`` → ``send_weights`` /
``receive_weights`` → ``finalize``):

* ``prepare``: actor rank 0 (``is_master``) opens a private ``TCPStore`` on a free port (port 0: no
  race) and returns its address and a fresh token; nobody else does anything.
* ``build_topology``: actor rank 0 is rank 0 of the sync's group, the rollout workers ranks
  1..n; the other actor ranks get -1 and stay out.
* ``init_process_group``: each member builds its own ``ProcessGroupGloo`` on that store (keys
  under the token). The default process group (the FSDP world on the actor, the rollout world on
  the rollout worker) is never used, and nothing is registered with ``torch.distributed``.
* ``send_weights`` (rank 0): the weights are cut into ``bucket_size`` chunks with verl's
  ``split_weight_chunks`` and packed into two alternating buckets; a bucket's metadata goes through
  the store, its bytes by a gloo broadcast that runs while the next bucket is filled (the
  generator's own collectives on the default group go on in between). Actor ranks -1 walk their
  generator, whose per-tensor collectives rank 0 needs.
* ``receive_weights`` (rollout): each bucket lands in a fresh buffer, the next one is received while
  this one is yielded, and verl's ``merge_weight_chunks`` rebuilds tensors larger than a bucket.
  The tensors yielded stay valid after the generator moves on. Bitwise: bytes are moved, any dtype.
* Both ends close with a barrier of the sync's group, so ``finalize`` (dropping the group and the
  store) never cuts a transfer short.

Every wait is bounded by ``timeout_s``: a rendezvous or a transfer that never completes raises
:class:`GlooSyncError` naming its phase instead of hanging.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import pickle
import secrets
import time
from typing import Any, AsyncIterator, Callable

from otb_tir.verl.glue import after_import

logger = logging.getLogger(__name__)

# and GlooCheckpointEngine, built on first use (module __getattr__)
__all__ = ["BACKEND", "DEFAULT_TIMEOUT_S", "GlooSyncError", "register"]

BACKEND = "gloo"
DEFAULT_TIMEOUT_S = 300.0
ALIGN = 16  # bytes: every tensor starts at a multiple of this in a bucket, so its bytes can be viewed as its dtype


class GlooSyncError(RuntimeError):
    """A phase of a weight sync failed or did not complete within the engine's timeout."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"gloo checkpoint engine: {phase}: {message}")
        self.phase = phase


def _own_host(host: str | None) -> str:
    """The address this process is reached at: ``host`` if given, else Ray's node address in a Ray
    worker, else loopback."""
    if host:
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001 - no Ray, or not in a Ray worker: one host
        pass
    return "127.0.0.1"


def _address_towards(host: str) -> str:
    """This machine's address on its route to ``host``: where the sync's other members reach this
    one (a rollout worker on another machine than the actor's rank 0 binds its own address, not the
    master's). No packet is sent; a UDP socket's ``connect`` only picks the route."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return _own_host(None)


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class _GlooEngineMethods:
    """The engine's methods; :data:`GlooCheckpointEngine` is this class over verl's abstract
    ``CheckpointEngine`` (built on first use, so importing this module does not import verl)."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        host: str | None = None,
    ) -> None:
        if int(bucket_size) <= 0:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.timeout_s = float(timeout_s)
        self.host = host
        self.rank: int | None = None
        self.world_size: int | None = None
        self._server = None  # the master's TCPStore server, prepare → finalize
        self._store = None  # this member's view of it (PrefixStore of the sync's token)
        self._pg = None  # the sync's private ProcessGroupGloo
        self._master: dict | None = None

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    # ------------------------------------------------------------------ verl's contract
    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 opens the sync's store; returns what :meth:`build_topology` needs."""
        self.finalize()  # a sync that failed half-way leaves nothing behind
        if not self.is_master:
            return {"master": False}
        from torch.distributed import TCPStore

        host = _own_host(self.host)
        try:
            self._server = TCPStore(host, 0, None, True, timeout=self._timeout, wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001
            raise GlooSyncError("prepare (open the store)", f"{type(exc).__name__}: {exc}") from exc
        return {
            "master": True,
            "host": host,
            "port": int(self._server.port),
            "token": secrets.token_hex(8),
            "bucket_size": self.bucket_size,
        }

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 → rank 0, rollout worker i → rank 1 + i, other actor ranks → -1 (out)."""
        master = metadata[0]
        if not (isinstance(master, dict) and master.get("master")):
            raise GlooSyncError("build_topology", f"actor rank 0 must be the master (is_master=True); got {master!r}")
        world_size = 1 + rollout_world_size
        actor = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master_metadata": [master] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict) -> None:
        """Join the sync's private gloo group (blocks until all members have joined, at most
        ``timeout_s``)."""
        self.rank, self.world_size, self._master = int(rank), int(world_size), dict(master_metadata)
        if self.rank < 0:
            return
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        host, port = master_metadata["host"], int(master_metadata["port"])
        where = f"rank {self.rank} of {self.world_size}, store {host}:{port}"
        if self.rank == 0:
            if self._server is None:
                raise GlooSyncError("init_process_group", f"rank 0 without a store: prepare() was not called ({where})")
            store = self._server
        else:
            try:
                store = TCPStore(host, port, None, False, timeout=self._timeout)
            except Exception as exc:  # noqa: BLE001
                raise GlooSyncError(
                    "init_process_group (connect to the store)",
                    f"no store within {self.timeout_s:g}s ({where}): {type(exc).__name__}: {exc}",
                ) from exc
        self._store = PrefixStore(f"otb_tir_gloo/{master_metadata['token']}/", store)
        options = ProcessGroupGloo._Options()
        options._timeout = self._timeout
        # rank 0 binds the address it published in prepare(); every other member its route's address to rank 0
        own = host if self.rank == 0 else _address_towards(host)
        options._devices = [ProcessGroupGloo.create_device(hostname=own)]
        try:
            self._pg = ProcessGroupGloo(self._store, self.rank, self.world_size, options)
        except Exception as exc:  # noqa: BLE001
            self._store = None
            raise GlooSyncError(
                "init_process_group (rendezvous)",
                f"not all {self.world_size} members joined within {self.timeout_s:g}s ({where}): "
                f"{type(exc).__name__}: {exc}",
            ) from exc
        logger.info("gloo checkpoint engine: joined (%s)", where)

    def finalize(self) -> None:
        """Drop the sync's group and store (idempotent)."""
        self.rank = self.world_size = self._master = None
        self._pg = None
        self._store = None
        self._server = None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Rank 0 sends; the other actor ranks walk their generator. Returns rank 0's figures."""
        from verl.workers.rollout.utils import ensure_async_iterator

        if self.rank is None:
            raise GlooSyncError("send_weights", "init_process_group was not called")
        if self.rank < 0:  # producing each weight is collective over the actor group
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if self.rank != 0 or self._pg is None:
            joined = self._pg is not None
            raise GlooSyncError("send_weights", f"not the sender of this sync (rank {self.rank}, joined: {joined})")
        return await self._send(weights)

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        """Yields ``(name, tensor)`` in the sender's order, bit-identical to what it sent."""
        from verl.checkpoint_engine.base import merge_weight_chunks

        if self.rank is None or self.rank < 1 or self._pg is None:
            raise GlooSyncError("receive_weights", f"not a receiver of this sync (rank {self.rank})")
        bucket_size = int(self._master["bucket_size"])  # the sender's: it decides what was cut into chunks
        async for name, tensor in merge_weight_chunks(self._receive_chunks(), bucket_size):
            yield name, tensor
        await self._barrier("receive_weights (closing barrier)")

    # ------------------------------------------------------------------ the transfer
    async def _send(self, weights: Any) -> dict[str, float]:
        import torch
        from verl.checkpoint_engine.base import split_weight_chunks

        start = time.monotonic()
        buffers = [torch.empty(self.bucket_size, dtype=torch.uint8) for _ in range(2)]
        current, offset, index, metas, sent = 0, 0, 0, [], 0
        pending: tuple[Any, str] | None = None  # the broadcast in flight and its phase

        async for meta, chunk in split_weight_chunks(_detached(weights), self.bucket_size):
            start_at = _align(offset)
            if metas and start_at + meta.chunk_size > self.bucket_size:
                pending = await self._flush(buffers[current], offset, metas, index, False, pending)
                sent += offset
                current, offset, index, metas, start_at = 1 - current, 0, index + 1, [], 0
            meta.offset = start_at
            buffers[current][start_at : start_at + meta.chunk_size].copy_(chunk)
            offset = start_at + meta.chunk_size
            metas.append(meta)
        pending = await self._flush(buffers[current], offset, metas, index, True, pending)
        sent += offset
        if pending is not None:
            await self._wait(*pending)
        await self._barrier("send_weights (closing barrier)")
        seconds = time.monotonic() - start
        logger.info("gloo checkpoint engine: sent %d bytes in %d buckets, %.2fs", sent, index + 1, seconds)
        return {
            "checkpoint_engine/gloo_bytes": float(sent),
            "checkpoint_engine/gloo_buckets": float(index + 1),
            "checkpoint_engine/gloo_seconds": seconds,
        }

    async def _flush(
        self, buffer: Any, length: int, metas: list, index: int, last: bool, pending: tuple[Any, str] | None
    ) -> tuple[Any, str] | None:
        """Publish bucket ``index``'s metadata and start its broadcast; first wait for the previous
        one, whose buffer is filled next."""
        if pending is not None:
            await self._wait(*pending)
        phase = f"send_weights (bucket {index})"
        payload = pickle.dumps({"tensors": metas, "length": length, "last": last})
        await self._call(lambda: self._store.set(f"bucket/{index}", payload), phase + " metadata")
        if length == 0:
            return None
        return self._pg.broadcast(buffer[:length], 0, self._timeout), phase

    async def _receive_chunks(self) -> AsyncIterator[tuple[Any, Any]]:
        index = 0
        meta, buffer, work = await self._post_receive(index)
        while True:
            if work is not None:
                await self._wait(work, f"receive_weights (bucket {index})")
            current_meta, current = meta, buffer
            if not current_meta["last"]:  # the next bucket travels while this one is consumed
                meta, buffer, work = await self._post_receive(index + 1)
            for tensor_meta in current_meta["tensors"]:
                yield tensor_meta, current[tensor_meta.offset : tensor_meta.offset + tensor_meta.chunk_size]
            if current_meta["last"]:
                return
            index += 1

    async def _post_receive(self, index: int) -> tuple[dict, Any, Any]:
        import torch

        raw = await self._call(lambda: self._store.get(f"bucket/{index}"), f"receive_weights (bucket {index} metadata)")
        meta = pickle.loads(raw)
        buffer = torch.empty(meta["length"], dtype=torch.uint8)  # fresh: what was yielded before stays valid
        work = self._pg.broadcast(buffer, 0, self._timeout) if meta["length"] else None
        return meta, buffer, work

    # ------------------------------------------------------------------ bounded waits
    async def _call(self, fn: Callable[[], Any], phase: str) -> Any:
        """``fn()`` (a store operation, bounded by the store's timeout) off the event loop."""
        try:
            return await asyncio.to_thread(fn)
        except Exception as exc:  # noqa: BLE001
            raise GlooSyncError(phase, f"{self._where()}: {type(exc).__name__}: {exc}") from exc

    async def _wait(self, work: Any, phase: str) -> None:
        try:
            await asyncio.to_thread(work.wait, self._timeout)
        except Exception as exc:  # noqa: BLE001
            raise GlooSyncError(
                phase, f"not complete within {self.timeout_s:g}s ({self._where()}): {type(exc).__name__}: {exc}"
            ) from exc

    async def _barrier(self, phase: str) -> None:
        from torch.distributed import BarrierOptions

        options = BarrierOptions()
        options.timeout = self._timeout
        await self._wait(self._pg.barrier(options), phase)

    def _where(self) -> str:
        master = self._master or {}
        return f"rank {self.rank} of {self.world_size}, store {master.get('host')}:{master.get('port')}"


async def _detached(weights: Any) -> AsyncIterator[tuple[str, Any]]:
    """verl's weight stream as contiguous tensors without autograd (``split_weight_chunks`` views
    their bytes)."""
    from verl.workers.rollout.utils import ensure_async_iterator

    async for name, tensor in ensure_async_iterator(weights):
        yield name, tensor.detach().contiguous()


# --------------------------------------------------------------------------- the class and its registration
_classes: dict[str, type] = {}


def _engine_class() -> type:
    cls = _classes.get("GlooCheckpointEngine")
    if cls is None:
        from verl.checkpoint_engine.base import CheckpointEngine

        built = type(
            "GlooCheckpointEngine",
            (_GlooEngineMethods, CheckpointEngine),
            {"__module__": __name__, "__doc__": __doc__.split("\n\n")[0]},
        )
        cls = _classes.setdefault("GlooCheckpointEngine", built)
    return cls


def __getattr__(name: str) -> Any:  # PEP 562: GlooCheckpointEngine is built on first use (it needs verl)
    if name == "GlooCheckpointEngine":
        return _engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(module: Any = None) -> type:
    """Register the engine as ``gloo`` in verl's ``CheckpointEngineRegistry`` (idempotent)."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    cls = _engine_class()
    if CheckpointEngineRegistry._registry.get(BACKEND) is not cls:
        CheckpointEngineRegistry.register(BACKEND)(cls)
    return cls


after_import("verl.checkpoint_engine.base", register)
