"""What computes logits: the ``ModelBackend`` protocol, a local 🤗 model, the swarm."""
