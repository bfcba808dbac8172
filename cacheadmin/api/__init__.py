"""REST API for release tooling and operators (DRF)."""
