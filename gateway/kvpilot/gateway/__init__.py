"""kvpilot-gateway: one OpenAI endpoint in front of every ModelDeployment (architecture §3.7)."""
