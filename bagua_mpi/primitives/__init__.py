"""Communication primitives over flat tensors, used by the algorithms (docs/design.md).

=========  ===================================  ===========================================
name       semantics                            function
=========  ===================================  ===========================================
C_FP_S     sum/average of all ranks             ``bagua_mpi.allreduce_`` (+ hierarchical)
C_LP_S     compressed sum with error feedback   ``compressed_allreduce_``
           16-bit wire, float32 sums            ``cast_allreduce_``
D_FP_S     average with ring/random peers       ``decentralized_average_``
D_LP_S     compressed difference exchange       ``low_precision_decentralized_``
sparse     top-k pairs, all-gathered            ``topk_allgather_``
sparse     gTopKAllReduce tree                  ``gtopk_allreduce_``
low-rank   PowerSGD rank-r P/Q, two allreduces  ``powersgd_allreduce_``
=========  ===================================  ===========================================

``packed_compressed_allreduce_`` and ``packed_gtopk_allreduce_`` run C_LP_S and gTop-k over several
tensors with per-tensor codecs / k in one exchange (L-GreCo's per-layer levels);
``lowprec.CompressedExchange``, ``sparse.GTopKExchange`` and ``lowrank.LowRankExchange`` are those
exchanges planned once, for a caller that runs one every step. The two-level (hierarchical) form of
every centralized algorithm is the algorithm framework's.
"""
from .centralized import cast_allreduce_
from .codecs import Codec, MinMaxCodec, OneBitCodec, QSGDCodec
from .decentralized import (PeerEstimates, decentralized_average_, low_precision_decentralized_,
                            peers_for, random_pairing, ring_peers)
from .lowprec import (Segment, compressed_allreduce_, packed_compressed_allreduce_,
                      padded_length, partition_length)
from .lowrank import LowRankSegment, initial_q, powersgd_allreduce_
from .sparse import (SparseSegment, gtopk_allreduce_, packed_gtopk_allreduce_, topk_allgather_,
                     topk_count)

__all__ = [
    "cast_allreduce_", "compressed_allreduce_", "padded_length", "partition_length",
    "decentralized_average_", "low_precision_decentralized_", "PeerEstimates", "peers_for",
    "random_pairing", "ring_peers", "Codec", "MinMaxCodec", "QSGDCodec", "OneBitCodec",
    "Segment", "packed_compressed_allreduce_", "SparseSegment",
    "packed_gtopk_allreduce_", "gtopk_allreduce_", "topk_allgather_", "topk_count",
    "LowRankSegment", "initial_q", "powersgd_allreduce_",
]
