"""kvpilot-operator: reconciles ModelDeployments into runtime pods and scales them (kopf).

`api` is the ModelDeployment schema (it generates the CRD: `crdgen`); `handlers` wires kopf;
`cli`, `config`, `lease` and `observability` run the process. Rooms: planning/ (node types,
quantisation and tensor-parallel fit, cost), reconcile/ (one pass: desired state, children,
status, the queue of passes), autoscaling/ (the policy, its loop, metrics, the simulator),
quality/ (quantisation admitted by measured quality). Imports kvpilot.contract and itself, never
the runtime or the gateway (tests/test_import_graph.py).
"""
