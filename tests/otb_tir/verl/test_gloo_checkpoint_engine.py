"""The ``gloo`` checkpoint engine (:mod:`otb_tir.verl.gloo_engine`) at the engine level: real
processes, no Ray, no vLLM.

Three processes, each with its own default gloo group first (the actor's FSDP world of 2 ranks, the
rollout's world of 1), play verl's weight sync twice with different weights: this process does what
``CheckpointEngineManager.update_weights`` does (``prepare`` everywhere, ``build_topology``,
``init_process_group`` everywhere, then ``send_weights`` / ``receive_weights``, then ``finalize``).
The actor ranks walk a generator that all-reduces every tensor on the default group, as FSDP's full
state gathering does. The rollout receives fp32 and bf16 tensors and two larger than a bucket, bit
for bit; the default groups still work afterwards and hold no extra group. A rendezvous or a
transfer that never completes is an error naming its phase.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import queue
import threading
import traceback

import pytest
import torch

from tests.support.optional import need

need("verl")

import otb_tir.verl.cpu  # noqa: E402,F401  (what verl's processes load: its import registers the engine)
from otb_tir.verl.gloo_engine import GlooSyncError  # noqa: E402

BUCKET = 4096  # bytes
SYNCS = 2
WAIT_S = 180  # for a child's message: a hang guard only, nothing is timed


def _weights(sync: int) -> dict[str, torch.Tensor]:
    """The full tensors of sync ``sync`` (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + sync)
    return {
        "embed.weight": torch.randn(33, 17, generator=g),  # fp32, 2244 bytes
        "norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),  # bf16, odd size: the next one is realigned
        "layer.big": torch.randn(3000, generator=g),  # fp32, 12000 bytes: three chunks
        "layer.big_bf16": torch.randn(50, 50, generator=g).to(torch.bfloat16),  # bf16, 5000 bytes: two chunks
        "head.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "head.weight": torch.randn(3, 11, generator=g),
    }


def _fsdp_like(sync: int, rank: int):
    """Actor rank ``rank``'s stream: each full tensor made by an all-reduce on the default group."""
    import torch.distributed as dist

    for name, full in _weights(sync).items():
        part = full.clone() if rank == 0 else torch.zeros_like(full)
        dist.all_reduce(part)  # x + 0 is x, bit for bit
        yield name, part


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _member(role: str, rank: int, init_file: str, commands, results) -> None:
    """One process: its default group, then SYNCS syncs as verl's workers run them."""
    try:
        import torch.distributed as dist
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        world = 2 if role == "actor" else 1
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        groups = len(dist.distributed_c10d._world.pg_map)
        # as verl builds it: the actor with is_master, the rollout's CheckpointEngineWorker without
        extra = {"is_master": dist.get_rank() == 0} if role == "actor" else {}
        engine = CheckpointEngineRegistry.new("gloo", bucket_size=BUCKET, timeout_s=60, **extra)
        for sync in range(SYNCS):
            assert commands.get(timeout=WAIT_S) == "prepare"
            results.put((role, rank, "prepare", engine.prepare()))
            engine.init_process_group(**commands.get(timeout=WAIT_S))
            report: dict = {}
            if role == "actor":
                report["metrics"] = asyncio.run(engine.send_weights(_fsdp_like(sync, rank), global_steps=sync))
            else:

                async def receive(step: int = sync):
                    return [(name, tensor) async for name, tensor in engine.receive_weights(global_steps=step)]

                got = asyncio.run(receive())  # the tensors are kept past the generator's next step on purpose
                expected = _weights(sync)
                report["names"] = [name for name, _ in got]
                report["same"] = {
                    name: t.dtype == expected[name].dtype
                    and t.shape == expected[name].shape
                    and _bytes(t) == _bytes(expected[name])
                    for name, t in got
                }
                report["digest"] = hashlib.sha256(b"".join(_bytes(t) for _, t in got)).hexdigest()
            engine.finalize()
            # the default group is untouched: it still reduces, over the same members, and no group was added
            probe = torch.tensor([float(rank + 1)])
            dist.all_reduce(probe)
            report["default_group"] = (
                dist.get_world_size(),
                probe.item(),
                len(dist.distributed_c10d._world.pg_map) - groups,
            )
            results.put((role, rank, "done", report))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((role, rank, "error", traceback.format_exc()))


def _collect(results, what: str, n: int, procs) -> dict:
    got = {}
    while len(got) < n:
        try:
            role, rank, kind, payload = results.get(timeout=WAIT_S)
        except queue.Empty:
            alive = {p.name: p.exitcode for p in procs}
            message = f"no '{what}' message from every member within {WAIT_S}s; exit codes {alive}"
            raise AssertionError(message) from None
        if kind == "error":
            raise AssertionError(f"{role} rank {rank} failed:\n{payload}")
        assert kind == what, (role, rank, kind)
        got[(role, rank)] = payload
    return got


@pytest.mark.slow
def test_two_syncs_bitwise_through_private_groups_with_the_default_groups_intact(tmp_path):
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    cls = CheckpointEngineRegistry.get("gloo")
    assert issubclass(cls, CheckpointEngine)

    # forkserver: fresh children (no inherited threads), verl imported once for the three of them
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["verl.checkpoint_engine.base", "otb_tir.verl.cpu"])
    results = ctx.Queue()
    members = [("actor", 0), ("actor", 1), ("rollout", 0)]
    commands = {m: ctx.Queue() for m in members}
    procs = []
    for role, rank in members:
        init_file = str(tmp_path / f"{role}_world")
        p = ctx.Process(
            target=_member, args=(role, rank, init_file, commands[(role, rank)], results), name=f"{role}{rank}"
        )
        p.start()
        procs.append(p)
    try:
        reports = []
        for _sync in range(SYNCS):
            # CheckpointEngineManager.build_process_group: metadata in rank order, actors first
            for m in members:
                commands[m].put("prepare")
            prepared = _collect(results, "prepare", len(members), procs)
            actor_kw, rollout_kw = cls.build_topology(2, 1, [prepared[m] for m in members])
            for i in range(2):
                commands[("actor", i)].put({k: v[i] for k, v in actor_kw.items()})
            commands[("rollout", 0)].put({k: v[0] for k, v in rollout_kw.items()})
            reports.append(_collect(results, "done", len(members), procs))
        for p in procs:
            p.join(WAIT_S)
            assert p.exitcode == 0, (p.name, p.exitcode)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()

    assert actor_kw["rank"] == [0, -1] and rollout_kw["rank"] == [1]
    digests = []
    for sync, report in enumerate(reports):
        rollout = report[("rollout", 0)]
        assert rollout["names"] == list(_weights(sync)), "every tensor, in the sender's order"
        assert all(rollout["same"].values()), rollout["same"]
        digests.append(rollout["digest"])
        sender = report[("actor", 0)]["metrics"]
        assert sender["checkpoint_engine/gloo_bytes"] >= sum(t.nbytes for t in _weights(sync).values())
        assert sender["checkpoint_engine/gloo_buckets"] > 2  # several buckets, so the pipelining ran
        assert report[("actor", 1)]["metrics"] == {}  # drained its generator, sent nothing
        assert report[("actor", 0)]["default_group"] == (2, 3.0, 0)
        assert report[("actor", 1)]["default_group"] == (2, 3.0, 0)
        assert report[("rollout", 0)]["default_group"] == (1, 1.0, 0)
    assert digests[0] != digests[1], "the second sync carried the second weights"


# --------------------------------------------------------------------------- phases that never complete
def _engine(**kw):
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    return CheckpointEngineRegistry.new("gloo", bucket_size=1024, timeout_s=1.0, **kw)


def _kwargs(topology: dict, i: int) -> dict:
    return {k: v[i] for k, v in topology.items()}


@pytest.mark.timeout(120)  # a hang guard: the engine's own timeout is 1 s
def test_a_rendezvous_nobody_else_joins_is_an_error_naming_the_phase():
    master = _engine(is_master=True)
    actor_kw, _ = type(master).build_topology(1, 1, [master.prepare(), {"master": False}])
    with pytest.raises(GlooSyncError, match=r"init_process_group \(rendezvous\).*not all 2 members joined") as err:
        master.init_process_group(**_kwargs(actor_kw, 0))
    assert err.value.phase == "init_process_group (rendezvous)"
    master.finalize()


@pytest.mark.timeout(120)
def test_a_store_that_is_gone_is_an_error_naming_the_phase():
    master = _engine(is_master=True)
    _, rollout_kw = type(master).build_topology(1, 1, [master.prepare(), {"master": False}])
    master.finalize()  # the master went away before the rollout worker connected
    with pytest.raises(GlooSyncError, match=r"init_process_group \(connect to the store\)"):
        _engine().init_process_group(**_kwargs(rollout_kw, 0))


@pytest.mark.timeout(120)
def test_a_sender_that_never_sends_is_an_error_naming_the_phase():
    """Both members joined, but the actor never calls send_weights: the receiver gives up."""
    master, receiver = _engine(is_master=True), _engine()
    actor_kw, rollout_kw = type(master).build_topology(1, 1, [master.prepare(), {"master": False}])
    joined = threading.Thread(target=master.init_process_group, kwargs=_kwargs(actor_kw, 0))
    joined.start()
    receiver.init_process_group(**_kwargs(rollout_kw, 0))
    joined.join()

    async def receive():
        return [item async for item in receiver.receive_weights()]

    with pytest.raises(GlooSyncError, match=r"receive_weights \(bucket 0 metadata\)"):
        asyncio.run(receive())
    receiver.finalize()
    master.finalize()


# --------------------------------------------------------------------------- members on other machines
@pytest.mark.timeout(180)
def test_each_member_binds_its_own_address_not_the_masters_host():
    """verl hands every member the same ``engine_kwargs`` (``host`` is the actor rank 0's address):
    a rollout worker on another machine must bind its own address, or it cannot join. Here the
    master is at 127.0.0.2 and the receiver's route to it starts at 127.0.0.1 (two "machines" on
    one loopback): the master listens at 127.0.0.2 and the receiver at 127.0.0.1 (on the old code both
    bound 127.0.0.2, which only works where the member *is* that machine), and the weights arrive."""
    import psutil

    master = _engine(is_master=True, host="127.0.0.2")
    receiver = _engine(host="127.0.0.2")  # the same options, as verl gives them
    master.timeout_s = receiver.timeout_s = 60.0
    actor_kw, rollout_kw = type(master).build_topology(1, 1, [master.prepare(), {"master": False}])

    def listening() -> set:
        return {c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}

    before = listening()  # the store's (it listens on every interface) and what earlier tests left
    joined = threading.Thread(target=master.init_process_group, kwargs=_kwargs(actor_kw, 0))
    joined.start()
    receiver.init_process_group(**_kwargs(rollout_kw, 0))
    joined.join()
    try:
        # the group's listening sockets: one per member, at the address it bound
        assert sorted(a.ip for a in listening() - before) == ["127.0.0.1", "127.0.0.2"]
        weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
        sent = threading.Thread(target=lambda: asyncio.run(master.send_weights(iter(weights.items()))))
        sent.start()

        async def receive():
            return [(name, t.clone()) async for name, t in receiver.receive_weights()]

        got = asyncio.run(receive())
        sent.join()
        assert [n for n, _ in got] == ["w"] and torch.equal(got[0][1], weights["w"])
    finally:
        receiver.finalize()
        master.finalize()
