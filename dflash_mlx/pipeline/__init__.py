"""The target pipelined across processes (several Macs) with ``mx.distributed``; DFlash on top.

``stages``: the layer split; ``link``: messages and lost ranks; ``cycle``: the protocol of one
request. ``dflash_mlx.load`` builds a rank's part when ``mx.distributed.init()`` has more than one
rank; see docs/pipeline.md.
"""

from .cycle import Pipeline, PipelinedTarget
from .link import PeerLost
from .stages import Stage, StageError

__all__ = ["Pipeline", "PipelinedTarget", "PeerLost", "Stage", "StageError"]
