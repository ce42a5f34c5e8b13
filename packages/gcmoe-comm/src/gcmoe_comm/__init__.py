"""gcmoe-comm: the token ring, symmetric-memory signalling, and the dispatch (role1) and finalize (role3) kernels."""

__version__ = "0.1.0"
