"""cluster.yaml: pydantic models with vLLM's own knob names (schema.py) and loading with field-path errors (load.py)."""
