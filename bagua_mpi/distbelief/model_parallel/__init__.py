"""One model replica partitioned over several ranks (paper §3).

Modules, from the bookkeeping up:

* ``partition``: how units (layers, rows, features) are cut into blocks and which units must
  cross each cut (pure bookkeeping: no MPI, no torch);
* ``link``: the messages between the partitions of a replica, as torch autograd functions
  (the pipeline send/receive, and the halo exchange and gather);
* ``layers``: layers that can be cut within themselves (``LocallyConnected2d``,
  ``LinearBlocks``);
* ``model``: the partitioned model (``PipelineModel`` by layers, ``BlockModel`` within them).

Each partition is then a parameter-server worker for its own parameter range
(``model.param_range``); this package itself knows nothing of the parameter servers.
"""
from .layers import LinearBlocks, LocallyConnected2d
from .link import Link
from .model import BlockModel, PipelineModel
from .partition import exchange_plan, split_units

__all__ = ["BlockModel", "LinearBlocks", "Link", "LocallyConnected2d", "PipelineModel",
           "exchange_plan", "split_units"]
