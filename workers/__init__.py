"""kvplane workers: pull transfer jobs and move KV pages (torch, local and NIXL transports)."""
