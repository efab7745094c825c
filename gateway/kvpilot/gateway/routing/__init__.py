"""Which replica serves a request: the route table, replicas' load, prefix affinity, picking,
holding requests while a model wakes from zero, and cascade rules to smaller models."""
