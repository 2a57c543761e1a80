"""Two Ray nodes on this host: where verl puts the trainer's pool and a standalone rollout replica.

verl does not pin resource pools to nodes: each pool is a STRICT_PACK placement group of bundles
``{"CPU": max_colocate_count, <accelerator>: 1}`` (``verl/single_controller/ray/base.py``
``RayResourcePool.get_placement_groups``). On a cluster whose nodes have one (logical) GPU each,
capacity alone puts separate_async's trainer pool (``global_pool: [1]``, ``trainer_base.py``) and its
standalone rollout replica's pool (``rollout_pool_0: [1]``, ``replica.py`` ``init_standalone``) on
different nodes. This test builds that two-node cluster with Ray's own test API
(``ray.cluster_utils.Cluster``), creates both pools with verl's real ``ResourcePoolManager`` under
our CPU platform, and reads the node of every bundle from Ray's placement-group table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.optional import need

REPO = Path(__file__).resolve().parents[3]

PROBE = r"""
import json, os, sys
from otb_tir.verl import cpu
os.environ.update(cpu.cpu_env())
cpu.apply(force=True)  # the CPU platform, as in every process of a CPU run
import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

cluster = Cluster(
    initialize_head=True,
    head_node_args={"num_cpus": 4, "num_gpus": 1, "object_store_memory": 80 * 2**20},
)
cluster.add_node(num_cpus=4, num_gpus=1, object_store_memory=80 * 2**20)
ray.init(address=cluster.address)
try:
    cluster.wait_for_nodes()
    from verl.single_controller.ray import ResourcePoolManager
    from verl.utils.device import get_device_name

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    where = {}
    for name, colocate in (("global_pool", 3), ("rollout_pool_0", 2)):  # trainer_base.py, replica.py
        mgr = ResourcePoolManager(resource_pool_spec={name: [1]}, mapping={}, max_colocate_count=colocate)
        mgr.create_resource_pool()
        pgs = mgr.resource_pool_dict[name].get_placement_groups(device_name=get_device_name())
        where[name] = [sorted(set(placement_group_table(pg)["bundles_to_node_id"].values())) for pg in pgs]
    # a third single-GPU pool cannot be placed: the two nodes' one GPU each are taken
    mgr = ResourcePoolManager(resource_pool_spec={"third": [1]}, mapping={}, max_colocate_count=1)
    try:
        mgr.create_resource_pool()
        third = "created"
    except ValueError as e:
        third = f"ValueError: {e}"
    print(json.dumps({"nodes": nodes, "where": where, "third": third}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.verl
@pytest.mark.slow
def test_trainer_pool_and_rollout_replica_land_on_different_nodes(tmp_path):
    need("verl")
    need("ray")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(facts["nodes"]) == 2
    trainer, rollout = facts["where"]["global_pool"], facts["where"]["rollout_pool_0"]
    assert len(trainer) == 1 and len(trainer[0]) == 1 and len(rollout) == 1 and len(rollout[0]) == 1
    assert trainer[0][0] != rollout[0][0]  # the trainer's pool and the rollout replica: different nodes
    assert {trainer[0][0], rollout[0][0]} == set(facts["nodes"])
    assert facts["third"].startswith("ValueError") and "less than total desired GPUs" in facts["third"]
