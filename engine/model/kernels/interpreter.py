"""Fixes to triton 3.6's interpreter (``TRITON_INTERPRET=1``: the CPU runs the engine's Triton
kernels for tests and for the benchmarks' kernel count). ``triton_attention.jit_in_place`` applies
them when it jits a kernel under the interpreter; compiled kernels are unaffected."""

from __future__ import annotations

import numpy as np
import torch


def patch_interpreter() -> None:
    """Three fixes to triton 3.6's interpreter (CPU runs only; compiled kernels are unaffected):
    a cast from fp32 to bfloat16 truncates where the GPU rounds to nearest even (it is done with
    torch's conversion here);
    ``range()`` over loaded scalars calls ``int()`` on a 1-element array, an error since numpy
    2.4 (triton-lang/triton#9171, fixed upstream by #9172); ``tl.dot`` on bfloat16 multiplies
    the uint16 storage (#11584): the operands are converted to fp32 first, which is what the
    GPU's bf16 x bf16 -> fp32 products give."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_kvfleet_patched", False):
        return
    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == interpreter.tl.bfloat16:
            f32 = interpreter.tl.float32
            a = interpreter.TensorHandle(interpreter._convert_float(a.data, a.dtype, f32, None).view("float32"), f32)
            b = interpreter.TensorHandle(interpreter._convert_float(b.data, b.dtype, f32, None).view("float32"), f32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    convert_float = interpreter._convert_float

    def patched_convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == interpreter.tl.float32 and output_dtype == interpreter.tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return convert_float(values, input_dtype, output_dtype, rounding_mode)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter._convert_float = patched_convert
    interpreter._kvfleet_patched = True
