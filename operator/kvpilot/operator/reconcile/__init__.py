"""One reconcile pass, planned then executed (KubeAI's split): `desired_state.desire` is pure
(ModelDeployment + what the pass observed -> children and status), `manifests` builds the
children, `conditions` and `typed_status` the status; `controller` executes a pass against the
API, `passes` and `workqueue` schedule passes on kopf's loop."""
