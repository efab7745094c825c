"""A small stand-in for the kubelet on local-execution nodes: pods run as real local processes.

It exists for the dev cluster, tests and the demo only: kwok fakes every other node, while pods
bound to a node labelled kvpilot.dev/local-execution=true really run, so Prometheus scrapes real
runtime processes and the autoscaler acts on real load.
"""
