"""The vLLM side of pdserve: the server entry with its patches, built-in models, names both sides share."""
