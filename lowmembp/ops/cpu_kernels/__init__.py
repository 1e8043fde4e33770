"""One-pass C kernels of the CPU fast path (the default on CPU tensors), loaded with ctypes from ``kernels.c``.

- :mod:`~lowmembp.ops.cpu_kernels.build`: compiles the source on first use, caches and loads the library
  (``LOWMEMBP_CPU_KERNELS=0`` turns it off), and the calling convention the wrappers share;
- :mod:`~lowmembp.ops.cpu_kernels.approx_act`: ReGELU2 / ReSiLU2's 2-bit codes and their backward;
- :mod:`~lowmembp.ops.cpu_kernels.mesa_quant`: Mesa's 8-bit quantise, dequantise and training-mode pack;
- :mod:`~lowmembp.ops.cpu_kernels.ms_norm`: MS-LayerNorm's forward (a replica of ATen's CPU LayerNorm), the MS-norms'
  backward (with a replica of ATen's CPU row sum), their casts, and the probes that find ATen's arithmetic;
- :mod:`~lowmembp.ops.cpu_kernels.autograd_ext`: the C++ autograd node of ReGELU2 / ReSiLU2 (``autograd.cpp``, on these
  kernels), compiled on first use (``LOWMEMBP_CPU_EXT=0`` turns it off).

Every name is importable from here, where the ops call them. Each wrapper returns ``None`` when the library is
unavailable: the callers then run their eager ATen ops, which give the same bits. The kernels reproduce the PyTorch
references' arithmetic bit for bit (IEEE fp32 operations one at a time: the build passes ``-ffp-contract=off`` and
never a fast-math flag; fp16 / bf16 converted exactly and rounded to nearest even). Where a result holds a NaN whose
bits ATen's conversions decide, a kernel reports it and the caller recomputes with its eager ops. Threads: an OpenMP
team of ``torch.get_num_threads()`` per call, each thread one contiguous range; ctypes releases the GIL for the call.
"""
from __future__ import annotations

from lowmembp.ops.cpu_kernels.approx_act import (NONFINITE, TINY_BF16, check, codes2, codes2_trusted, read_byte,
                                                 read_byte_trusted, slopes2, slopes2_trusted, write_byte)
from lowmembp.ops.cpu_kernels.build import (COMPILERS, ENV_SWITCH, FLAGS, LIBS, MIN_PER_THREAD, SOURCE, build_info,
                                            compiler, library, round_to)
from lowmembp.ops.cpu_kernels.autograd_ext import extension, extension_info
from lowmembp.ops.cpu_kernels.mesa_quant import (PACK8_AMBIGUOUS, PACK8_NAN, PACK8_SKIPPED, dequantize8,
                                                 dequantize8_trusted, mesa_pack8, mesa_pack8_trusted, quantize8)
from lowmembp.ops.cpu_kernels.ms_norm import (LN_ADD_M1_FUSED, LN_ADD_M2_FUSED, LN_FLAG_NAMES, LN_OUT_SHIFT,
                                              LN_OUTPUTS, LN_TAIL_FUSED, LN_VEC_FMA, LN_VEC_M1_FUSED, LN_WIDTHS,
                                              SUM_WIDTHS, LayerNormVariant, addcmul_fused, aten_sum_width, cast,
                                              layer_norm_fwd, layer_norm_fwd_trusted, layer_norm_probe_rows,
                                              layer_norm_variant, layer_norm_variants, norm_bwd, norm_bwd_passes,
                                              norm_bwd_rows, norm_bwd_rows_trusted, norm_prod, row_sums)

__all__ = ["ENV_SWITCH", "COMPILERS", "FLAGS", "LIBS", "SOURCE", "MIN_PER_THREAD", "compiler", "library", "build_info",
           "round_to", "read_byte", "read_byte_trusted", "write_byte", "NONFINITE", "TINY_BF16", "codes2",
           "codes2_trusted", "check", "slopes2", "slopes2_trusted", "quantize8", "dequantize8", "dequantize8_trusted",
           "mesa_pack8", "mesa_pack8_trusted", "PACK8_NAN", "PACK8_AMBIGUOUS", "PACK8_SKIPPED", "norm_prod", "norm_bwd",
           "cast", "norm_bwd_passes", "addcmul_fused", "SUM_WIDTHS", "aten_sum_width", "row_sums", "norm_bwd_rows",
           "norm_bwd_rows_trusted", "LN_VEC_FMA", "LN_VEC_M1_FUSED", "LN_ADD_M1_FUSED", "LN_ADD_M2_FUSED",
           "LN_TAIL_FUSED", "LN_OUT_SHIFT", "LN_OUTPUTS", "LN_WIDTHS", "LN_FLAG_NAMES", "layer_norm_fwd",
           "layer_norm_fwd_trusted", "layer_norm_variant", "layer_norm_variants", "layer_norm_probe_rows",
           "LayerNormVariant", "extension", "extension_info"]
