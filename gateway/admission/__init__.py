"""What a request passes before it runs: API keys, size limits, rate limits, the capacity line."""
