"""API keys and spend: who calls (`keys`), budget arithmetic (`arithmetic`, pure), where counters
live (`store`: memory or Redis), the policy that reserves and settles (`policy`), its config."""
