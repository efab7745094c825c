"""The engine: requests in, batches stepped, tokens out (nano-vllm's vocabulary).

`engine.Engine` runs the step loop (`async_engine` drives it for asyncio); `scheduler` and
`block_manager` are pure Python (one token budget, paged KV with prefix caching); `model_runner`
runs a scheduled batch; `sizing` and `loading` size and load it; `speculative`, `draft_model`,
`spec_step` and `spec_governor` are speculative decoding; `grammar` and `structured` constrain
output. Imports kvpilot.contract, models/, layers/ and itself; never server/.
"""
