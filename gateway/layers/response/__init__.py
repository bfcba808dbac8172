"""The response cache layer: whole answers served again for the same canonical request."""
