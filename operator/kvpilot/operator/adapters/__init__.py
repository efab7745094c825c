"""LoRA adapters in running pods (issue 34): which pod should hold which adapter (placement),
the runtime's load/unload API (pod_api), and the loop that brings the two together (sync)."""
