"""Paged-attention kernels: CuPy RawKernel CUDA sources (kernels/cuda/, compiled by NVRTC at
first use), batched torch kernels for the CPU (kernels.cpu, with the C kernel of
kernels.cpu_native for decode rows where it builds), and the torch reference that defines
their semantics; kernels.selection picks the family a layer runs."""
