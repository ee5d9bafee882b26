"""KVCache-centric scheduling: route each request where its predicted TTFT is lowest.

``api.py`` is the contract every router implements; the core, the fleet simulator
(``benchmarks/``) and the HTTP server in front of SGLang all speak it. Nothing here does I/O
except the server.
"""
