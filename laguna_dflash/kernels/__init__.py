"""Triton kernels for the GPU fast path; each has a torch reference it is tested against
(on the GPU, and on the CPU under ``TRITON_INTERPRET=1``)."""
