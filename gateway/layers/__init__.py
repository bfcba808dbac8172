"""The gateway's cache layers, one package each, in the order a request meets them.

A layer is a package ``gateway/layers/<name>/`` whose ``layer`` module has
``build(runtime) -> CacheLayer`` (:class:`gateway.layers.base.CacheLayer`) and
a line in :data:`LAYERS`. Records, metrics and the control plane's layer
choices read their names from :data:`LAYERS` (a test holds them to it).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from gateway.layers.base import CacheLayer

#: The cache layers, in the order a request meets them: each one a package of this name.
LAYERS: Final = ("response", "semantic")


def build_layers(runtime: Any, names: Sequence[str] = LAYERS) -> list[CacheLayer]:
    """Each layer of ``names`` built for ``runtime`` (a :class:`gateway.server.Runtime`), in order.

    Raises:
        ValueError: a built layer's ``name`` is not its package's (the name is written once).
    """
    layers = []
    for name in names:
        layer = importlib.import_module(f"gateway.layers.{name}.layer").build(runtime)
        if layer.name != name:
            raise ValueError(f"layer {name}: built a layer named {layer.name!r}")
        layers.append(layer)
    return layers
