"""Triton kernels (attention, Mamba2 decode, norms, rotary) with their torch fallbacks' switches."""
