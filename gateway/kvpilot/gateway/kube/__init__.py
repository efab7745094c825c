"""The gateway on Kubernetes: discovery (watches ModelDeployments and their pods into routes),
waking a model at zero replicas, and API keys from a Secret. Talks to the apiserver only through
kvpilot.contract.k8s."""
