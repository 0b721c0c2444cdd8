"""The table that tells a segmented min-max kernel where each segment lies.

One int64 row per segment; the kernels read it at ``cuda.blockIdx.z`` (the grid's z axis is the
segment), so the columns are module constants, which Numba compiles in.
"""
X_OFF = 0      # first element of the segment's values in the base array (x, or out)
X_LEN = 1      # its elements there
E_OFF = 2      # first element of its error memory in the residual base (rows * PART of them)
PART = 3       # elements of one row's payload: ceil(X_LEN / rows), or X_LEN for a stack's sum
BITS = 4       # code width
PCOL = 5       # its parameters' first float32 column in a row
WCOL = 6       # its codes' first uint32 column in a row
BOFF = 7       # its codes' byte offset inside its payload (8-bit codes are stored as bytes)
COL = 8        # its payload's first byte column in a row
USED = 9       # bytes of its payload that hold data (the rest is zero padding)
NBYTES = 10    # bytes of its payload
COLUMNS = 11
