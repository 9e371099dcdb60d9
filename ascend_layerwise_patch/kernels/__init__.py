"""Triton kernels this library installs in place of vllm-ascend's.

Importing this package (or its modules) imports neither torch nor triton: each kernel is a
launcher object whose Triton code is compiled on its first launch (see ``postprocess``).
"""
