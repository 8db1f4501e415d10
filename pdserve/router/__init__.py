"""The KV-cache-aware P/D router: its own package and process (`python -m pdserve.router --config FILE`).

It imports nothing from the rest of pdserve but `errors`: it runs under supervision like a vLLM server.
"""
