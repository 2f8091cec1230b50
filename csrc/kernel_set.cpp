// A kernel set's one exported symbol: its entry points, for ops.cpp (which dlopens the set's library).
#include "kernels.h"

extern "C" const fast_decode::KernelSet* fast_decode_kernels() {
    using namespace fast_decode;
    static const KernelSet set = {gemv_bf16, gemv_int8, gemv_int4, dequantize_int4, attend, attend_int8,
                                  attend_paged, decode_step, forward_rows, forward_paged, greedy, decode_greedy};
    return &set;
}
