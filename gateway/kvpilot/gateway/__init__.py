"""kvpilot-gateway: one OpenAI endpoint in front of every ModelDeployment (docs/architecture.md §3.7)."""
