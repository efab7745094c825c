"""The builtin autoscaler: `policy.decide` (pure) turns observations into replicas, `loop` runs it
every interval, `metrics_reader` reads the runtime's metrics (Prometheus or the pods),
`recording` says what to write where, `spread` places replicas across node types; `simulator`
compares policies on traces (`kvpilot simulate`). It writes one number per Deployment into the
status; reconcile acts on it."""
