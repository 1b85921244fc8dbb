"""Finding, planning, loading and sharding models: the registry, sources, GGUF, stand-ins."""
