"""Adapters that plug kvplane's engine path into inference engines (``vllm``: vLLM's KV
connector). Each imports its engine lazily: importing this package needs neither."""
