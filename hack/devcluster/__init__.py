"""Local dev cluster from source: `python -m hack.devcluster up|down|status|env|build`."""

from hack.devcluster.cluster import DevCluster
from hack.devcluster.errors import DevClusterError

__all__ = ["DevCluster", "DevClusterError"]
