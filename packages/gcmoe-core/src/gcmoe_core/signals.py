"""Error words the kernels of several packages record into a rank's workspace (pure Python: no CuTe DSL).

A failed bounded wait writes (code 1, kind, who, generation, value seen) once (the first failure wins); every kernel
of the layer starts by reading the code word and does nothing once it is set. The host sets the code word to WARMUP
while it loads kernels (each is launched once and returns at once). gcmoe_comm.workspace owns the layout of the words
and says each failure in words; the grouped GEMMs only get the words' addresses.
"""

ERR_FAILED = 1
ERR_WARMUP = 2
KIND_READY, KIND_RECV, KIND_OFFS, KIND_BLOCK, KIND_BUSY, KIND_W1 = 1, 2, 3, 4, 5, 6
