"""pdserve: one command for prefill/decode disaggregated vLLM with bidirectional NIXL KV reuse."""

__version__ = "0.1.0"
