"""Precise prefix routing: the fleet's block index (:mod:`gateway.prefix.index`), a request's
block hashes as engines compute them (:mod:`gateway.prefix.predict`) and the engine choice
that scores both (:mod:`gateway.prefix.router`)."""
