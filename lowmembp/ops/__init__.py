"""Ops: each file holds one op family's Triton kernel(s), PyTorch reference, autograd.Function and nn.Module."""
