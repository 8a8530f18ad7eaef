"""The OpenAI wire types the gateway reads and writes (chat completions, completions, models, errors), and
the strict request parser. The Responses API's own types are in gateway/responses/schema.py."""
