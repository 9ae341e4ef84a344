"""Triton kernels of the block-sparse cache (GPU; CPU tests run them with TRITON_INTERPRET=1).

Import these modules only where Triton is wanted: kvchat.kv.kernels picks them or the torch
reference, so kvchat imports without Triton installed.
"""
