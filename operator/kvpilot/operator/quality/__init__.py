"""Quantisation admitted by quality measured on the user's eval set: `admission` (pure) decides,
`job` is the eval Job (`kvpilot-runtime eval`), `io` reads and writes what it needs."""
