"""Django-free core of the KV cache control plane.

Identity fingerprints, engine clients and launcher, KV tier stores, prewarm and
comparison algorithms, and builders for the demo checkpoints. Nothing in this
package imports Django: the control-plane app calls into it, never the reverse.
"""
