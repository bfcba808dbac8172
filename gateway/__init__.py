"""The data plane: an OpenAI-compatible gateway that applies the control plane's
routing, salts and cache layers to live requests."""
