"""kvpilot.contract: what crosses a process boundary, torch-free, in one place.

The operator writes pods that run the runtime, the gateway reads the runtime's /metrics and the
operator's ModelDeployments, the autoscaler queries the runtime's metrics in Prometheus. What
both sides of each of these must agree on lives here and nowhere else:

- serve flags: `engine_config.EngineConfig` + `serve_config.ServeConfig` are the schema of
  `kvpilot-runtime serve`; the runtime parses with `serve_config.parser()`, the operator writes
  pod args with `serve_config.to_args`; `speculative_config` is `--speculative-config`'s schema.
- memory arithmetic (`memory`): the planner sizes node types with it, the runtime its KV pool.
- model facts: `catalog` (popular models), `remote_config` (config.json at the source).
- model and dataset sources: `model_source`, `dataset_source` (the URI forms), `fetch` (copying
  them, which the runtime does and the operator's config.json read shares).
- `resource`: the ModelDeployment's group/version/kind, the wake annotation, the pod labels, the
  served-name rule; `k8s` and `timestamps`: the one Kubernetes client the operator and the
  gateway use to read and write them.
- `metric_names`: the runtime's metrics the autoscaler and the gateway read.

Imports: the standard library and itself; `k8s` the kubernetes client (the operator's and the
gateway's extras), `fetch` huggingface_hub and boto3 where a function needs them. Never torch,
never kvpilot.runtime, .operator or .gateway (tests/test_import_graph.py).
"""
