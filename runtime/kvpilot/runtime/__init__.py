"""kvpilot.runtime: the continuous-batching engine and its OpenAI-compatible server, the process
every ModelDeployment pod runs (`kvpilot-runtime serve`).

Rooms: engine/ (scheduling, KV blocks, the model runner, sampling, speculative decoding), server/
(HTTP, request and response models, metrics), models/ (checkpoints and architectures), layers/
(tensor building blocks); cli.py and evaluate.py (`kvpilot-runtime eval`) at the top; bench/ is
`kvpilot bench`, a load generator. Imports kvpilot.contract and itself, never the operator or the
gateway (tests/test_import_graph.py).
"""
