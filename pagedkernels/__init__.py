"""Paged-attention kernels: CuPy RawKernel CUDA sources (pagedkernels/cuda/, compiled by NVRTC at
first use), batched torch kernels for the CPU (pagedkernels.cpu, with the C kernel of
pagedkernels.cpu_native for decode rows where it builds), and the torch reference that defines
their semantics; pagedkernels.selection picks the family a layer runs."""
