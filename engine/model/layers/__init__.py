"""Layers the families share: attention, norms and MLPs, MoE, and the recurrent mixers (Mamba2, Gated DeltaNet)."""
