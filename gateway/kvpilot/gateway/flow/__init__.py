"""Flow control: request priorities and per-tenant fair queuing in front of the replicas."""
