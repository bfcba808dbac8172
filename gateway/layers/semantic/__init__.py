"""The semantic cache layer's matching: sentence embeddings, one similarity scale, meaning guards and admission rules."""
