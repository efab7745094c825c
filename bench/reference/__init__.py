"""Reference implementations the benchmarks and the tests both measure against: a small Llama
built from the engine's own parts, a sampler written row by row, and mixed attention batches.
They live beside the benchmarks because bench/ may not import tests/ (test_import_graph)."""
