"""The table that tells a segmented top-k kernel where each segment lies.

One int64 row per segment; the kernels read it at ``cuda.blockIdx.x`` (a block per segment), so
the columns are module constants, which Numba compiles in.
"""
X_OFF = 0      # first element of the segment's values in the base array (x, or out)
X_LEN = 1      # its elements there (n)
R_OFF = 2      # first element of its residual in the residual base (n of them)
K = 3          # entries its payload keeps
ICOL = 4       # its indices' first column in the message viewed as the index dtype
VCOL = 5       # its values' first float32 column in the message
COL = 6        # its payload's first byte column in the message
USED = 7       # bytes of its payload that hold data (the rest is zero padding)
NBYTES = 8     # bytes of its payload
U_OFF = 9      # first entry of its union (2 k entries) in a merge's scratch
SAMPLE = 10    # the host's approximate method: sample size m (0: the exact method)
SAMPLE_RANK = 11   # the sample's rank ks whose key is the threshold
CAPACITY = 12  # the candidates' capacity
COLUMNS = 13
