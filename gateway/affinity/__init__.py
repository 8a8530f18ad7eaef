"""Session affinity: which server-side KV caches hold which conversation, in memory or in Redis."""
