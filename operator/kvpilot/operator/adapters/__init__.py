"""LoRA adapters in running pods (issue 34): how many and which pods hold each adapter from its
demand (assignment, demand), what each pod loads or unloads (placement), the runtime's
load/unload API (pod_api), and the loop that brings them together (sync)."""
