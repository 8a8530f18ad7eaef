"""The OpenAI surface: wire types, request checks, prompts, SSE streams and the chat/completions handlers."""
