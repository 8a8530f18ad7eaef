"""OpenAI's Responses API (``POST /v1/responses``): input, turns, output items, streams, stored responses."""
