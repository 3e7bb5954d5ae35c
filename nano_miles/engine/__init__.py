"""The inference engine as the other stages see it: an HTTP client, a group of engines behind a router,
and the engine slot's launcher (library of `procs/engine.py`). The engine itself is SGLang on a GPU or
`nano_miles.local_engine` elsewhere; both serve the contract in docs/sglang-contract.md.
"""
