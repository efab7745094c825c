"""The OpenAI-compatible HTTP server over the engine.

`app` holds the routes and only translates HTTP; `handling` turns a validated request into engine
work (`job`) and `rendering` its outputs into bodies and SSE chunks; `request_models` and
`response_models` are the OpenAI schemas, `request_checks` and `body_parsing` what every body gets;
`lifecycle` loads, admits and drains; `metrics` is /metrics. Imports the engine, models/ and
kvpilot.contract.
"""
