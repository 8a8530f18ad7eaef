"""Tool calling: the request's tool plan, the model family's call format, the forcing grammar, the parser."""
