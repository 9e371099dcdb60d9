"""The gdn_layerwise groups, declared once: the GDN layer's wait with its align pre-copy
(``mamba_precopy``: applies with the per-layer wait, or not at all), and the 310P layer's wait (its
own group: a 310P-only module that fails must not take the main GDN patch with it)."""

from __future__ import annotations

from .._checks import Group
from .._ranges import SUPPORTED

GROUP = Group("gdn_layerwise", SUPPORTED)
GROUP_310P = Group("gdn_layerwise_310p", SUPPORTED)
