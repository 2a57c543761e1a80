"""A Ray cluster of several nodes on this one host, for ``trainer=verl`` across nodes without a second machine.

    .venv-verl/bin/python scripts/ray_two_nodes.py --out runs/two_nodes &   # prints the address, then waits
    .venv-verl/bin/python recipes/train_tir_math.py trainer=verl verl.trainer_mode=separate_async \\
        trainer.total_steps=4 verl.ray_address="$(cat runs/two_nodes/address)"
    kill %1                                                          # placement.json is written at exit

Each node is a raylet of its own (Ray's test API, ``ray.cluster_utils.Cluster``) declaring
``--cpus-per-node`` logical CPUs and ``--gpus-per-node`` logical GPUs (verl's resource pools count
Ray "GPU"s; the CPU profile computes on the CPU). With one GPU per node, separate_async's trainer
pool and its standalone rollout replica cannot share a node. While it runs, the script records every
placement group it sees (name → node of each bundle) and writes them with the node ids to
``OUT/placement.json`` when it is stopped (SIGTERM or Ctrl-C), then shuts the cluster down.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus-per-node", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/two_nodes"))
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    node = {"num_cpus": args.cpus_per_node, "num_gpus": args.gpus_per_node, "object_store_memory": 256 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    for _ in range(args.nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "address").write_text(cluster.address)
    print(f"address: {cluster.address} ({len(nodes)} nodes: {', '.join(n[:12] for n in nodes)})", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    seen: dict[str, dict] = {}
    while not stop.is_set():
        try:
            for pg_id, info in placement_group_table().items():
                if info.get("bundles_to_node_id"):
                    seen[pg_id] = {
                        "name": info.get("name", ""),
                        "nodes": sorted(set(info["bundles_to_node_id"].values())),
                        "bundles": {str(k): v for k, v in info.get("bundles", {}).items()},
                    }
        except Exception as exc:  # noqa: BLE001 - keep recording; say what failed
            print(f"placement_group_table: {exc}", flush=True)
        stop.wait(1.0)
    (args.out / "placement.json").write_text(json.dumps({"nodes": nodes, "placement_groups": seen}, indent=1))
    print(f"placement groups seen: {len(seen)}; written to {args.out / 'placement.json'}", flush=True)
    ray.shutdown()
    cluster.shutdown()
    time.sleep(0.5)


if __name__ == "__main__":
    main()
