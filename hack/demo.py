"""`make demo`: today, the dev cluster with its fake GPU node pools, as an operator would see it.

Later issues extend this into the whole story (plan, serve, load, scale up, scale down).
"""

from __future__ import annotations

import sys

from hack.devcluster import DevCluster, DevClusterError

NODE_COLUMNS = (
    "NAME:.metadata.name,"
    "TYPE:.metadata.labels.kvpilot\\.dev/node-type,"
    "GPU:.metadata.labels.nvidia\\.com/gpu\\.product,"
    "GPU-MEM-MiB:.metadata.labels.nvidia\\.com/gpu\\.memory,"
    "GPUS:.status.allocatable.nvidia\\.com/gpu,"
    "CPU:.status.allocatable.cpu,"
    "PRICE/H:.metadata.annotations.kvpilot\\.dev/price-per-hour,"
    "READY:.status.conditions[?(@.type=='Ready')].status"
)


def main() -> int:
    cluster = DevCluster()
    try:
        if not cluster.is_up():
            cluster.up()
        version = cluster.kubectl("version").stdout
        nodes = cluster.kubectl("get", "nodes", "-o", f"custom-columns={NODE_COLUMNS}").stdout
    except DevClusterError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 1
    print("\n==> control plane\n" + version)
    print("==> GPU node pools (kwok nodes with NVIDIA GPU Feature Discovery labels)\n" + nodes)
    print('Use it:   eval "$(make -s cluster-env)" && kubectl get nodes')
    print("Stop it:  make demo-down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
