"""Communication algorithms, registered by name (see ``base.py`` for the interface).

=============================  ===============================================  ==========
name                           what                                             primitive
=============================  ===============================================  ==========
gradient_allreduce             average gradients (fp16/bf16 wire optional)      C_FP_S
qsgd                           8-bit stochastic quantization, no EF             C_LP_S
bytegrad                       8-bit per-chunk min-max, no EF                   C_LP_S
onebit_adam                    Adam warm-up, then 1-bit momentum with EF        C_LP_S+EF
decentralized                  model averaging with random/ring peers           D_FP_S
low_precision_decentralized    8-bit ring exchange of model differences         D_LP_S
async                          background model averaging, never waits          C_FP_S
local_sgd                      average models every ``period`` steps            C_FP_S
topk                           top-k with residuals, all-gathered (O(kP))       sparse
gtopk                          top-k with residuals, gTopKAllReduce tree        sparse
powersgd                       rank-r P/Q power iteration with EF               low-rank
lgreco                         layer-wise bits/density/rank chosen by a DP      any of the
                               (the DP and families in ``bagua_mpi.lgreco``)    above
=============================  ===============================================  ==========
"""
from .async_average import AsyncModelAverage
from .base import (Algorithm, AlgorithmContext, AlgorithmImpl, UnsupportedOptionError,
                   WrapOptions)
from .compressed import QSGD, ByteGrad
from .gradient_allreduce import GradientAllReduce
from .lgreco import LGreCo, LGreCoImpl
from .model_averaging import Decentralized, LocalSGD, LowPrecisionDecentralized
from .onebit_adam import OneBitAdam
from .powersgd import PowerSGD
from .registry import create, names, register
from .sparse import GTopK, TopK

__all__ = ["Algorithm", "AlgorithmContext", "AlgorithmImpl", "UnsupportedOptionError",
           "WrapOptions", "AsyncModelAverage", "ByteGrad",
           "Decentralized", "GradientAllReduce", "LocalSGD", "LowPrecisionDecentralized",
           "OneBitAdam", "PowerSGD", "QSGD", "TopK", "GTopK", "LGreCo", "LGreCoImpl", "create",
           "names", "register"]
