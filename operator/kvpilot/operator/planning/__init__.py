"""What fits where: GPU node types from the cluster (`inventory`), the quantisation and
tensor-parallel degree each can hold (`planner`, by the memory arithmetic in kvpilot.contract),
model facts read at the source (`model_facts`), and cost per 1,000 requests (`cost`)."""
