"""graphfleet worker: model execution, scheduling, KV cache and sampling on one rank."""
